"""Bytes of the host tier (spec/host_tier.md): host-resident KV in (pinned)
host memory, and the swap path that runs the host tier's page transfers.

- :func:`host_group_memory`: the ``host_resident`` groups of a HiSparse
  ``KVCacheConfig``, allocated in host memory with ``host_num_blocks`` blocks
  (the host pool), never on the device (D-HOST-3);
- :class:`HostTierMemory`: a device cache of resident pages and its host
  mirror; ``run`` moves the pages of ``PageTransfer`` records between them,
  ``mirror_rows`` copies the token rows of ``RowMirror`` records (the rows a
  step just wrote) into the host pool.

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
from pagedkv.spec.hisparse import PageTransfer, RowMirror

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

    def mirror_rows(self, mirrors: Sequence[RowMirror]) -> None:
        """Copy each mirror's token rows, in every layer and every per-token
        view (key and value, or the MLA latent), from the device cache into
        the host cache. Slots are ``block id * block_size + offset``.
        Cost: one slice copy per mirror, view and layer.

        Raises:
            InvalidArgumentError: a mirror leaves its block or either pool.
        """
        caches = [(name, layer, self.host_cache.layer(name))
                  for name, layer in self.device_cache.layers.items()]
        for mirror in mirrors:
            for name, device_layer, host_layer in caches:
                size = device_layer.spec.block_size
                device_block, offset = divmod(mirror.device_slot, size)
                host_block, host_offset = divmod(mirror.host_slot, size)
                if (offset != host_offset or mirror.num_rows < 1
                        or offset + mirror.num_rows > size
                        or not 0 < device_block < self.device_cache.num_blocks
                        or not 0 < host_block < self.host_cache.num_blocks):
                    raise InvalidArgumentError(f"mirror {mirror} does not fit layer {name}'s blocks")
                rows = slice(offset, offset + mirror.num_rows)
                for view in ("key", "value", "latent"):
                    if view in device_layer.views:
                        host_layer.views[view][host_block, rows] = (
                            device_layer.views[view][device_block, rows].to(self.host_cache.device))
