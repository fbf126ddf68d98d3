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

from pagedkv.optimized.tensor.block_ops import check_block_pairs, swap_blocks
from pagedkv.optimized.tensor.checks import check_int
from pagedkv.optimized.tensor.memory import KVCacheMemory
from pagedkv.spec.config import KVCacheConfig, KVCacheTensor
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError, UnknownBlockError
from pagedkv.spec.hisparse import PageTransfer, RowMirror

__all__ = ["HostTierMemory", "can_pin_host_memory", "host_group_memory"]


def can_pin_host_memory() -> bool:
    """Whether page-locked host memory is available (a CUDA runtime is)."""
    return torch.cuda.is_available()


def _resolve_pin(pin_memory: bool | None) -> bool:
    # None: pin where it helps; True on a CPU-only machine: skip cleanly.
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise InvalidArgumentError(f"pin_memory must be a bool or None, got {pin_memory!r}")
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
        InvalidArgumentError: ``config`` is not a ``KVCacheConfig``, or
            ``pin_memory`` is not a bool or ``None``.
    """
    if not isinstance(config, KVCacheConfig):
        raise InvalidArgumentError(f"config must be a KVCacheConfig, got {type(config).__name__}")
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
        """Allocate the host mirror of ``device_cache`` with ``host_num_blocks``
        blocks, pinned where CUDA is present (``pin_memory=None``).

        Raises:
            InvalidArgumentError: ``device_cache`` is not a ``KVCacheMemory``,
                or ``pin_memory`` is not a bool or ``None``.
            InvalidConfigError: ``host_num_blocks`` is not an int >= 2.
        """
        if not isinstance(device_cache, KVCacheMemory):
            raise InvalidArgumentError(
                f"device_cache must be a KVCacheMemory, got {type(device_cache).__name__}")
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

        Every transfer is checked before a page moves.

        Raises:
            InvalidArgumentError: not a ``PageTransfer``, a transfer of an
                unknown kind, or a null or repeated target block
                (``check_block_pairs``).
            UnknownBlockError: a block id outside its pool.
        """
        writebacks: list[tuple[int, int]] = []
        restores: list[tuple[int, int]] = []
        device_blocks, host_blocks = self.device_cache.num_blocks, self.host_cache.num_blocks
        for i, transfer in enumerate(transfers):
            if not isinstance(transfer, PageTransfer):
                raise InvalidArgumentError(
                    f"transfers[{i}] must be a PageTransfer, got {type(transfer).__name__}")
            for field, block, pool in (("device_block", transfer.device_block, device_blocks),
                                       ("host_block", transfer.host_block, host_blocks)):
                if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < pool:
                    raise UnknownBlockError(
                        f"transfers[{i}].{field} is {block!r}, outside its pool [0, {pool})")
            if transfer.kind == "writeback":
                writebacks.append((transfer.device_block, transfer.host_block))
            elif transfer.kind == "restore":
                restores.append((transfer.host_block, transfer.device_block))
            else:
                raise InvalidArgumentError(f"transfer {transfer.transfer_id} has kind "
                                           f"{transfer.kind!r}, expected writeback or restore")
        # Both batches are checked whole (null or repeated targets) before the first moves a byte.
        check_block_pairs(writebacks, device_blocks, host_blocks)
        check_block_pairs(restores, host_blocks, device_blocks)
        swap_blocks(self.device_cache, self.host_cache, writebacks)
        swap_blocks(self.host_cache, self.device_cache, restores)

    def mirror_rows(self, mirrors: Sequence[RowMirror]) -> None:
        """Copy each mirror's token rows, in every layer and every per-token
        view (key and value, or the MLA latent), from the device cache into
        the host cache. Slots are ``block id * block_size + offset``.
        Cost: one slice copy per mirror, view and layer.

        Raises:
            InvalidArgumentError: not a ``RowMirror``, a field not an int, or
                a mirror leaves its block or either pool; every mirror is
                checked before a row is copied.
        """
        caches = [(name, layer, self.host_cache.layer(name))
                  for name, layer in self.device_cache.layers.items()]
        mirrors = list(mirrors)  # walked twice: checks, then copies
        for i, mirror in enumerate(mirrors):
            if not isinstance(mirror, RowMirror):
                raise InvalidArgumentError(
                    f"mirrors[{i}] must be a RowMirror, got {type(mirror).__name__}")
            check_int(f"mirrors[{i}].device_slot", mirror.device_slot, 0)
            check_int(f"mirrors[{i}].host_slot", mirror.host_slot, 0)
            check_int(f"mirrors[{i}].num_rows", mirror.num_rows, 1)
            for name, device_layer, _ in caches:
                size = device_layer.spec.block_size
                device_block, offset = divmod(mirror.device_slot, size)
                host_block, host_offset = divmod(mirror.host_slot, size)
                if (offset != host_offset or offset + mirror.num_rows > size
                        or not 0 < device_block < self.device_cache.num_blocks
                        or not 0 < host_block < self.host_cache.num_blocks):
                    raise InvalidArgumentError(
                        f"mirrors[{i}] {mirror} does not fit layer {name}'s blocks")
        for mirror in mirrors:
            for _, device_layer, host_layer in caches:
                size = device_layer.spec.block_size
                device_block, offset = divmod(mirror.device_slot, size)
                host_block = mirror.host_slot // size
                rows = slice(offset, offset + mirror.num_rows)
                for view in ("key", "value", "latent"):
                    if view in device_layer.views:
                        host_layer.views[view][host_block, rows] = (
                            device_layer.views[view][device_block, rows].to(self.host_cache.device))
