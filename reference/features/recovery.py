"""Recovery after an exception interrupted a change (spec/operations.md,
"Exception safety"; D-API-24). Not part of vLLM's manager, so not part of
the kernel: the facade calls :func:`recover` only when an exception escapes.

The request lists are the source of truth; everything else (ref counts, the
cache map, the free queue, the set of known requests) is rebuilt from them
and from the blocks' own hashes. Run only after an exception, never on a
normal path.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.spec.types import BlockHashWithGroupId, get_group_id

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator as Coordinator

__all__ = ["recover"]


def _recover_requests(coordinator: Coordinator) -> None:
    """Every request id any group (or the coordinator) tracks is known, with
    a list and a cached count in every group; a list drops any block it
    holds twice (or a reserved one), and a windowed list's nulls form a
    prefix again."""
    managers = coordinator.managers
    known: set[str] = set(coordinator.known)
    for manager in managers:
        known.update(manager.req_to_blocks)
        known.update(manager.num_cached_blocks)
    coordinator.known.clear()
    coordinator.known.update(known)
    reserved = {id(block) for block in coordinator.block_pool.reserved}
    null_block = coordinator.block_pool.null_block
    for request_id in known:
        held: set[int] = set()  # the blocks this request holds, over all groups
        for manager in managers:
            blocks = manager.req_to_blocks.setdefault(request_id, [])
            blocks[:] = _without_repeats(blocks, held, reserved)
            if isinstance(manager, (SlidingWindowManager, ChunkedLocalAttentionManager)):
                _nulls_before_last_null(blocks, null_block)
            cached = max(manager.num_cached_blocks.get(request_id, 0), 0)
            manager.num_cached_blocks[request_id] = min(cached, len(blocks))
    for manager in managers:
        for attribute in ("last_state_block",):
            table = getattr(manager, attribute, None)
            if isinstance(table, dict):
                for request_id in [r for r in table if r not in known]:
                    del table[request_id]
        given = getattr(manager, "given_state", None)
        if isinstance(given, set):
            given.intersection_update(known)


def _without_repeats(blocks: list[KVCacheBlock], held: set[int], reserved: set[int]) -> list[KVCacheBlock]:
    """``blocks`` less each real block the request already holds (``held``,
    updated) or that is reserved (REQ-6); the null block may repeat."""
    kept: list[KVCacheBlock] = []
    for block in blocks:
        if block.is_null or not (id(block) in held or id(block) in reserved):
            held.add(id(block))
            kept.append(block)
    return kept


def _nulls_before_last_null(blocks: list[KVCacheBlock], null_block: KVCacheBlock) -> None:
    """A windowed list's skipped positions are a prefix (SKIP-1): the
    exception came while positions before its last null were being skipped."""
    last_null = max((index for index, block in enumerate(blocks) if block.is_null), default=0)
    blocks[:last_null] = [null_block] * last_null


def _recover_pool(pool: BlockPool, num_groups: int, holders: Counter[int]) -> None:
    """Ref counts from the holders, the cache map from the blocks' hashes,
    the free queue from the ref counts (keeping its order where it can)."""
    reserved = {block.block_id for block in pool.reserved}
    for block in pool.blocks:
        block.ref_cnt = 0 if block.is_null else holders[block.block_id] + (block.block_id in reserved)
        if block.is_null or not pool.enable_caching or block.block_id in reserved or (
                block.block_hash is not None and get_group_id(block.block_hash) >= num_groups):
            block.block_hash = None
    cached: dict[BlockHashWithGroupId, list[KVCacheBlock]] = {}
    for key, blocks in pool.cached.items():
        for block in blocks:
            if block.block_hash == key and block not in cached.get(key, []):
                cached.setdefault(key, []).append(block)
    for block in pool.blocks:
        if block.block_hash is not None and block not in cached.get(block.block_hash, []):
            cached.setdefault(block.block_hash, []).append(block)
    pool.cached.clear()
    pool.cached.update(cached)
    queue: list[KVCacheBlock] = []
    queued: set[int] = set()
    for block in pool.free_queue + pool.blocks[1:]:
        if block.ref_cnt == 0 and not block.is_null and block.block_id not in queued:
            queued.add(block.block_id)
            queue.append(block)
    pool.free_queue[:] = queue
    if not pool.enable_kv_cache_events:
        pool.events.clear()


def recover(coordinator: Coordinator) -> None:
    """Make the manager consistent again (invariants hold, every known
    request freeable, no block leaked) after an interrupted change."""
    _recover_requests(coordinator)
    holders: Counter[int] = Counter(
        block.block_id for manager in coordinator.managers
        for blocks in manager.req_to_blocks.values() for block in blocks if not block.is_null)
    for feature in coordinator.features:  # H7: copy retentions (MPART-3)
        holders.update(feature.held_blocks(coordinator))
    _recover_pool(coordinator.block_pool, len(coordinator.managers), holders)
    for manager in coordinator.managers:
        cached_this_step = getattr(manager, "cached_this_step", None)
        if isinstance(cached_this_step, set):
            cached_this_step.intersection_update(
                {key for key in cached_this_step if get_group_id(key) == manager.group_id})
