"""Bytes of the host tier (spec/host_tier.md): host-resident KV in (pinned)
host memory, and the swap path that runs the host tier's page transfers.

- :func:`host_group_memory`: the ``host_resident`` groups of a HiSparse
  ``KVCacheConfig``, allocated in host memory with ``host_num_blocks`` blocks
  (the host pool), never on the device (D-HOST-3);
- :class:`HostTierMemory`: a device cache of resident pages and its host
  mirror; ``run`` moves the pages of ``PageTransfer`` records between them.

Host memory is page-locked (pinned) only where CUDA is present, because only
then can a copy overlap with compute; on a CPU-only machine pinning is
skipped, not refused (D-HOST-6).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.optimized.tensor.block_ops import swap_blocks
from pagedkv.optimized.tensor.memory import KVCacheMemory
from pagedkv.spec.config import KVCacheConfig, KVCacheTensor
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.spec.hisparse import PageTransfer

__all__ = ["HostTierMemory", "can_pin_host_memory", "host_group_memory"]


def can_pin_host_memory() -> bool:
    """Whether page-locked host memory is available (a CUDA runtime is)."""
    return torch.cuda.is_available()


def _resolve_pin(pin_memory: bool | None) -> bool:
    # None: pin where it helps; True on a CPU-only machine: skip cleanly.
    return can_pin_host_memory() if pin_memory is None else pin_memory and can_pin_host_memory()


def host_group_memory(config: KVCacheConfig, host_num_blocks: int,
                      pin_memory: bool | None = None) -> KVCacheMemory:
    """The host-resident groups of ``config`` in host memory.

    One tensor per layer of ``page_size_bytes * host_num_blocks`` bytes; the
    device groups and ``config.num_blocks`` play no part (their bytes are the
    device planner's). Cost: O(host bytes), zeroed.

    Raises:
        InvalidConfigError: ``config`` has no host-resident group, or
            ``host_num_blocks`` is below 2 (block 0 is the null block).
    """
    if type(host_num_blocks) is not int or host_num_blocks < 2:
        raise InvalidConfigError(f"host_num_blocks must be an int >= 2, got {host_num_blocks!r}")
    groups = tuple(group for group in config.kv_cache_groups if group.host_resident)
    if not groups:
        raise InvalidConfigError("the KVCacheConfig has no host_resident group")
    tensors = tuple(KVCacheTensor(group.kv_cache_spec.page_size_bytes * host_num_blocks, (name,))
                    for group in groups for name in group.layer_names)
    host_config = KVCacheConfig(host_num_blocks, tensors, groups)
    return KVCacheMemory(host_config, "cpu", pin_memory=_resolve_pin(pin_memory))


class HostTierMemory:
    """Resident pages on a device and the host pool behind them.

    ``device_cache`` holds the resident pages (block ids of the device pool);
    the host mirror has the same layers with ``host_num_blocks`` blocks (block
    ids of the host pool). ``pinned`` tells whether the host side is
    page-locked.
    """

    def __init__(self, device_cache: KVCacheMemory, host_num_blocks: int,
                 pin_memory: bool | None = None) -> None:
        if type(host_num_blocks) is not int or host_num_blocks < 2:
            raise InvalidConfigError(
                f"host_num_blocks must be an int >= 2, got {host_num_blocks!r}")
        self.device_cache = device_cache
        self.host_cache = KVCacheMemory.host_mirror(device_cache, host_num_blocks,
                                                    pin_memory=_resolve_pin(pin_memory))
        self.pinned = all(t.is_pinned() for t in self.host_cache.tensors)

    def run(self, transfers: Sequence[PageTransfer]) -> None:
        """Move every transfer's page: write-backs device -> host, then restores
        host -> device. A transfer holds both its blocks until the manager's
        ``complete``, so no write-back source is a restore target of the same
        batch. Cost: two batched swaps.

        Raises:
            InvalidArgumentError: a transfer of an unknown kind, or a block id
                outside its pool (``swap_blocks``'s checks).
        """
        writebacks: list[tuple[int, int]] = []
        restores: list[tuple[int, int]] = []
        for transfer in transfers:
            if transfer.kind == "writeback":
                writebacks.append((transfer.device_block, transfer.host_block))
            elif transfer.kind == "restore":
                restores.append((transfer.host_block, transfer.device_block))
            else:
                raise InvalidArgumentError(f"transfer {transfer.transfer_id} has kind "
                                           f"{transfer.kind!r}, expected writeback or restore")
        swap_blocks(self.device_cache, self.host_cache, writebacks)
        swap_blocks(self.host_cache, self.device_cache, restores)
