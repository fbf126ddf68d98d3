"""Batched block operations: copy blocks within a cache, swap blocks between caches.

Semantics (``pagedkv.reference.features.tensor_model``): for every pair ``(src, dst)``,
the page of block ``dst`` becomes the page block ``src`` had *before* the
batch, in every tensor concerned; all sources are read before any destination
is written. A batch is checked whole before any byte moves: block ids in
range, the null block ``0`` never a destination, no destination twice.

Because the layout is block-major (``memory`` module), a block is one
contiguous page per tensor, so a batch is one ``index_select`` (gather into a
staging buffer) and one ``index_copy_`` (scatter) per arena, whatever the
number of layers and pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.optimized.tensor.checks import check_int
from pagedkv.optimized.tensor.memory import KVCacheMemory
from pagedkv.spec.errors import InvalidArgumentError, UnknownBlockError

__all__ = ["BlockPairs", "check_block_pairs", "copy_blocks", "swap_blocks"]

BlockPairs = Sequence[tuple[int, int]] | npt.NDArray[np.integer]
"""``(src, dst)`` block id pairs: a sequence of 2-tuples or an int array ``[n, 2]``."""


def check_block_pairs(pairs: BlockPairs, src_num_blocks: int,
                      dst_num_blocks: int) -> npt.NDArray[np.int64]:
    """Validate ``pairs`` and return them as an int64 array ``[n, 2]``.

    Valid: ``0 <= src < src_num_blocks``; ``1 <= dst < dst_num_blocks``; no
    destination twice. The error reported is the one of the first bad pair.

    Cost: O(n log n), vectorized.

    Raises:
        InvalidArgumentError: not ``n`` pairs of ints, the null block as a
            destination, a repeated destination, or a block count that is
            not an int >= 1.
        UnknownBlockError: a block id out of range.
    """
    check_int("src_num_blocks", src_num_blocks, 1)
    check_int("dst_num_blocks", dst_num_blocks, 1)
    given: object = pairs
    if isinstance(given, torch.Tensor):
        raise InvalidArgumentError(
            "pairs must be a sequence of (src, dst) int pairs or a numpy array, got a torch.Tensor")
    try:
        arr = np.asarray(pairs)
    except (TypeError, ValueError):  # ragged or not array-like
        arr = np.asarray(None)
    if arr.size == 0 and arr.ndim >= 1:
        return np.zeros((0, 2), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"pairs must be (src, dst) int pairs, got {pairs!r}")
    arr = arr.astype(np.int64, copy=False)
    src, dst = arr[:, 0], arr[:, 1]
    bad_src = (src < 0) | (src >= src_num_blocks)
    bad_dst = (dst < 0) | (dst >= dst_num_blocks)
    null_dst = dst == 0
    _, first = np.unique(dst, return_index=True)
    repeated = np.ones(len(dst), dtype=np.bool_)
    repeated[first] = False
    bad = bad_src | bad_dst | null_dst | repeated
    if bad.any():
        i = int(np.argmax(bad))
        if bad_src[i]:
            raise UnknownBlockError(f"pairs[{i}]: source block {src[i]} outside [0, {src_num_blocks})")
        if bad_dst[i]:
            raise UnknownBlockError(
                f"pairs[{i}]: destination block {dst[i]} outside [0, {dst_num_blocks})")
        if null_dst[i]:
            raise InvalidArgumentError(f"pairs[{i}]: the null block 0 cannot be a destination")
        raise InvalidArgumentError(f"pairs[{i}]: destination block {dst[i]} appears twice")
    return arr


_PAIRWISE_BYTES = 16 * 1024
"""Pages at least this large are copied block by block on the CPU."""


def _words(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` viewed as 8-byte words when the page allows: gathers and
    scatters then move 8x fewer elements (same bytes)."""
    return pages.view(torch.int64) if pages.shape[-1] % 8 == 0 else pages


def copy_blocks(cache: KVCacheMemory, pairs: BlockPairs, group_id: int | None = None) -> None:
    """Copy block ``src`` onto block ``dst`` for every pair, in every layer of
    KV cache group ``group_id`` (every layer when ``None``): copy-on-write and
    Mamba state copies.

    Cost: per arena holding the group's tensors, one gather and one scatter
    of ``n * page`` bytes per tensor (plus an ``n * page`` staging buffer); one
    small host-to-device copy of the indices.

    Raises:
        InvalidArgumentError: see :func:`check_block_pairs`, ``cache`` is not
            a ``KVCacheMemory``, or a bad group id.
        UnknownBlockError: see :func:`check_block_pairs`.
    """
    _check_cache("cache", cache)
    arr = check_block_pairs(pairs, cache.num_blocks, cache.num_blocks)
    if group_id is None:
        wanted = set(range(len(cache.tensors)))
    elif type(group_id) is int and 0 <= group_id < len(cache.group_tensors):
        wanted = set(cache.group_tensors[group_id])
    else:
        raise InvalidArgumentError(
            f"group_id {group_id!r} outside [0, {len(cache.group_tensors)}) (or None)")
    if len(arr) == 0:
        return
    index = torch.from_numpy(arr.T.copy()).to(cache.device)
    src, dst = index[0], index[1]
    # On the CPU, torch's byte gather/scatter is far slower than a memcpy per
    # block; copying pair by pair is equivalent when no destination is also
    # a source (nothing is overwritten before it is read).
    pairwise = cache.device.type == "cpu" and not set(arr[:, 1].tolist()) & set(arr[:, 0].tolist())
    for arena in cache.arenas:
        rows = [i for i, t in enumerate(arena.tensor_indices) if t in wanted]
        if not rows:
            continue
        if pairwise and len(rows) == len(arena.tensor_indices) and arena.page_bytes >= _PAIRWISE_BYTES:
            pages = arena.pages
            for source, target in arr.tolist():
                pages[:, target].copy_(pages[:, source])
        elif len(rows) == len(arena.tensor_indices):
            pages = _words(arena.pages)
            pages.index_copy_(1, dst, pages.index_select(1, src))
        else:
            # Only some tensors of the arena: each selected row in turn (rare: the
            # planner's configurations put every tensor in every group).
            for r in rows:
                arena.pages[r].index_copy_(0, dst, arena.pages[r].index_select(0, src))


def _check_cache(name: str, cache: object) -> None:
    if not isinstance(cache, KVCacheMemory):
        raise InvalidArgumentError(f"{name} must be a KVCacheMemory, got {type(cache).__name__}")


def _check_compatible(a: KVCacheMemory, b: KVCacheMemory) -> None:
    if a.config.kv_cache_groups != b.config.kv_cache_groups or [
            t.shared_by for t in a.config.kv_cache_tensors] != [
            t.shared_by for t in b.config.kv_cache_tensors]:
        raise InvalidArgumentError(
            "src_cache and dst_cache do not hold the same layers and specs")
    if [(x.page_bytes, x.tensor_indices) for x in a.arenas] != [
            (x.page_bytes, x.tensor_indices) for x in b.arenas]:
        raise InvalidArgumentError(
            "src_cache and dst_cache do not group their tensors the same way")


def swap_blocks(src_cache: KVCacheMemory, dst_cache: KVCacheMemory, pairs: BlockPairs) -> None:
    """Copy block ``src`` of ``src_cache`` onto block ``dst`` of ``dst_cache``
    for every pair, in every layer: offload (device to host) or reload (host
    to device); the caches must have the same layers (see
    ``KVCacheMemory.host_mirror``).

    Cost: per arena, a gather on the source device into a staging buffer
    (pinned when one side is CUDA), one transfer of ``n * page`` bytes per
    tensor, a scatter on the destination device. Host-to-device is
    asynchronous on the current stream; device-to-host returns when the host
    cache holds the data.

    Raises:
        InvalidArgumentError: see :func:`check_block_pairs`, a cache is not a
            ``KVCacheMemory``, or the caches differ in layers or layout.
        UnknownBlockError: see :func:`check_block_pairs`.
    """
    _check_cache("src_cache", src_cache)
    _check_cache("dst_cache", dst_cache)
    _check_compatible(src_cache, dst_cache)
    arr = check_block_pairs(pairs, src_cache.num_blocks, dst_cache.num_blocks)
    if len(arr) == 0:
        return
    src = torch.from_numpy(arr[:, 0].copy()).to(src_cache.device)
    dst = torch.from_numpy(arr[:, 1].copy()).to(dst_cache.device)
    pin = src_cache.device.type == "cpu" and dst_cache.device.type == "cuda"
    both_cpu = src_cache.device.type == "cpu" and dst_cache.device.type == "cpu"
    for src_arena, dst_arena in zip(src_cache.arenas, dst_cache.arenas):
        if both_cpu and src_arena.page_bytes >= _PAIRWISE_BYTES:
            # Two distinct buffers: a memcpy per block, no staging (see copy_blocks).
            for source, target in arr.tolist():
                dst_arena.pages[:, target].copy_(src_arena.pages[:, source])
            continue
        shape = (src_arena.pages.shape[0], len(arr), src_arena.page_bytes)
        staging = torch.empty(shape, dtype=torch.int8, device=src_cache.device, pin_memory=pin)
        torch.index_select(src_arena.pages, 1, src, out=staging)
        moved = staging.to(dst_cache.device, non_blocking=pin)
        dst_arena.pages.index_copy_(1, dst, moved)
