"""``check_invariants`` (spec/invariants.md): an ``InvariantViolation``
names the first broken invariant's ID and ends with a dump of the state."""

from __future__ import annotations

import pprint
from collections import Counter
from typing import TYPE_CHECKING

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.mamba import MambaManager
from pagedkv.reference.single_type import SinkFullAttentionManager
from pagedkv.spec.errors import InvariantViolation
from pagedkv.spec.types import get_group_id

if TYPE_CHECKING:
    from pagedkv.reference.manager import KVCacheManager

__all__ = ["check_pool", "check_manager"]


def _fail(invariant: str, message: str, state: object) -> InvariantViolation:
    return InvariantViolation(f"{invariant}: {message}\nstate:\n{pprint.pformat(state, width=120)}")


def _raise(violation: str | None, state: object) -> None:
    """Raise a hook's ``"<ID>: <what>"`` verdict, if any, as :func:`_fail` does."""
    if violation is not None:
        invariant, message = violation.split(": ", 1)
        raise _fail(invariant, message, state)


def check_pool(pool: BlockPool, num_groups: int) -> None:
    """POOL-*, CACHE-*, EVT-1: what the pool alone must satisfy."""
    state = pool.snapshot()
    # POOL-1: ids are positions; the null block is inert.
    if [block.block_id for block in pool.blocks] != list(range(pool.num_blocks)):
        raise _fail("POOL-1", "block ids are not 0..num_blocks-1", state)
    null = pool.blocks[0]
    if pool.null_block is not null or null.ref_cnt != 0 or null.block_hash is not None or any(
            block is null for block in pool.free_queue + pool.reserved):
        raise _fail("POOL-1", "the null block was counted, hashed or queued", state)
    # POOL-2: the free queue is exactly the unreferenced non-null blocks, once each.
    queued = [block.block_id for block in pool.free_queue]
    if len(set(queued)) != len(queued):
        raise _fail("POOL-2", "a block is in the free queue twice", state)
    unreferenced = {block.block_id for block in pool.blocks[1:] if block.ref_cnt == 0}
    if set(queued) != unreferenced:
        raise _fail("POOL-2", f"free queue {sorted(set(queued))} != unreferenced blocks {sorted(unreferenced)}", state)
    # POOL-3: reference counts are never negative.
    if any(block.ref_cnt < 0 for block in pool.blocks):
        raise _fail("POOL-3", "a negative ref count", state)
    # POOL-4: free count and usage follow the queue.
    if pool.get_num_free_blocks() != len(queued) or pool.get_usage() != rules.usage(len(queued), pool.num_blocks):
        raise _fail("POOL-4", "free count or usage disagrees with the free queue", state)
    # CACHE-1: block keys and the cache map agree exactly.
    for key, holders in pool.cached.items():
        ids = [block.block_id for block in holders]
        if not holders or len(set(ids)) != len(ids):
            raise _fail("CACHE-1", f"cache entry {key.hex()} is empty or repeats a block", state)
        if any(block.block_hash != key for block in holders):
            raise _fail("CACHE-1", f"a block under {key.hex()} carries another key", state)
    for block in pool.blocks:
        if block.block_hash is not None and all(block is not held for held in pool.cached.get(block.block_hash, [])):
            raise _fail("CACHE-1", f"block {block.block_id} carries a key the cache does not list", state)
    # CACHE-2: no caching, no keys.
    if not pool.enable_caching and (pool.cached or any(block.block_hash is not None for block in pool.blocks)):
        raise _fail("CACHE-2", "caching is disabled but a block carries a key", state)
    # CACHE-3: keys name existing groups.
    if any(get_group_id(key) >= num_groups for key in pool.cached):
        raise _fail("CACHE-3", "a cache key names a group that does not exist", state)
    # EVT-1: no events are kept unless asked for.
    if not pool.enable_kv_cache_events and pool.events:
        raise _fail("EVT-1", "events were recorded with events disabled", state)


def check_manager(manager: KVCacheManager) -> None:
    """Every invariant the state alone decides: the pool's, the request
    table's (REQ-1..6, the types' own, SINK-1, MAMBA-2), the features' (H8)."""
    pool = manager.block_pool
    managers = manager.coordinator.managers
    check_pool(pool, len(managers))
    known = manager.coordinator.known
    # REQ-5 first: the snapshot below reads every known request's lists.
    for group in managers:
        if set(group.req_to_blocks) != known or set(group.num_cached_blocks) != known:
            raise _fail("REQ-5", f"group {group.group_id} tracks {sorted(group.req_to_blocks)}, "
                        f"known requests are {sorted(known)}", pool.snapshot())
    state = manager.snapshot()
    # REQ-1: a block's ref count is the number of places requests hold it (plus one for a reserved sink block).
    holders: Counter[int] = Counter(block.block_id for block in pool.reserved)
    for feature in manager.coordinator.features:  # H7: e.g. copy endpoints (MPART-3)
        holders.update(feature.held_blocks(manager.coordinator))
    for group in managers:
        for blocks in group.req_to_blocks.values():
            holders.update(block.block_id for block in blocks if not block.is_null)
    for block in pool.blocks[1:]:
        if block.ref_cnt != holders[block.block_id]:
            raise _fail("REQ-1", f"block {block.block_id} has ref count {block.ref_cnt} but is held "
                        f"{holders[block.block_id]} times", state)
    for group in managers:
        for request_id, blocks in group.req_to_blocks.items():
            # REQ-2: the cached prefix lies within the held blocks.
            if not 0 <= group.num_cached_blocks[request_id] <= len(blocks):
                raise _fail("REQ-2", f"request {request_id!r} group {group.group_id} caches "
                            f"{group.num_cached_blocks[request_id]} of {len(blocks)} blocks", state)
            # REQ-3: a held hashed block is cached for the group holding it.
            for block in blocks:
                if block.block_hash is not None and get_group_id(block.block_hash) != group.group_id:
                    raise _fail("REQ-3", f"block {block.block_id} held in group {group.group_id} is "
                                f"cached for group {get_group_id(block.block_hash)}", state)
            # The type's own invariant, stated by its manager class: REQ-4 (full
            # attention), SKIP-1 (windowed), XATTN-1, RSWA-1, RING-1.
            _raise(group.check_request_blocks(request_id, blocks), state)
    reserved = {block.block_id for block in pool.reserved}
    for request_id in known:
        # REQ-6: a request holds each real block once over all groups, and no reserved block.
        ids = [block.block_id for group in managers for block in group.req_to_blocks[request_id]
               if not block.is_null]
        if len(set(ids)) != len(ids) or reserved & set(ids):
            raise _fail("REQ-6", f"request {request_id!r} holds a block twice or a sink block: {ids}", state)
    sink_blocks: list[KVCacheBlock] = []
    for group in managers:
        # SINK-1: sink blocks are held for good, unhashed, by the pool alone.
        if isinstance(group, SinkFullAttentionManager):
            sink_blocks.extend(group.sink_blocks)
            spec = manager.kv_cache_config.kv_cache_groups[group.group_id].kv_cache_spec
            sink_len = getattr(spec, "sink_len", None) or 0
            if len(group.sink_blocks) != sink_len // group.block_size or len({
                    block.block_id for block in group.sink_blocks}) != len(group.sink_blocks) or any(
                    block.ref_cnt != 1 or block.block_hash is not None or block.is_null
                    for block in group.sink_blocks):
                raise _fail("SINK-1", f"group {group.group_id}'s sink blocks are not held as reserved", state)
        # MAMBA-2: states cached this step are keys of this group.
        if isinstance(group, MambaManager) and any(get_group_id(key) != group.group_id
                                                   for key in group.cached_this_step):
            raise _fail("MAMBA-2", f"group {group.group_id} remembers another group's key", state)
    if sorted(block.block_id for block in sink_blocks) != sorted(reserved):
        raise _fail("SINK-1", "the reserved blocks are not exactly the sink groups' blocks", state)
    for feature in manager.coordinator.features:  # H8: the features' own invariants
        _raise(feature.check(manager.coordinator), state)
