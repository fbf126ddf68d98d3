"""The optimized implementation's ``check_invariants()``: every invariant of
spec/state.md that the state alone decides, by ID (the reference's
``reference/invariants.py`` checks the same IDs over its own representation).

Kept apart from ``block_pool.py`` so the hot modules stay small; the pool's
``check_invariants()`` calls :func:`check_pool_invariants`, the manager's
calls both. When everything works these are expensive no-ops; on failure they
raise :class:`~pagedkv.spec.errors.InvariantViolation` whose message starts
with the broken invariant's ID.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedkv.spec.errors import InvariantViolation
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator
    from pagedkv.optimized.pool.block_pool import BlockPool

__all__ = ["check_pool_invariants", "check_request_invariants"]


def check_pool_invariants(pool: BlockPool) -> None:
    """Check POOL-1..4, CACHE-1..3 and EVT-1; "an expensive no-op" when
    all is well. Cost: O(num_blocks + cached ids).

    Raises:
        InvariantViolation: the message starts with the invariant's ID.
    """
    def fail(inv: str, what: str) -> None:
        raise InvariantViolation(f"{inv}: {what}\nstate: {pool.snapshot()!r}")

    n = pool.num_blocks
    try:
        pool.free_queue.check()
    except AssertionError as exc:
        fail("POOL-2", f"free queue links broken: {exc}")
    queue = pool.free_queue.to_list()
    if len(pool.ref_counts) != n or len(pool.block_hashes) != n or len(pool.block_group_ids) != n:
        fail("POOL-1", f"per-block tables do not cover exactly the ids 0..{n - 1}")
    if pool.ref_counts[0] != 0 or pool.block_hashes[0] is not None or 0 in queue or 0 in pool.reserved:
        fail("POOL-1", "null block queued, referenced, hashed or reserved")
    queued = set(queue)
    if any(not 0 < b < n for b in queue):
        fail("POOL-2", "free queue holds an id outside [1, num_blocks)")
    for b in range(1, n):
        if pool.ref_counts[b] < 0:
            fail("POOL-3", f"block {b} has ref count {pool.ref_counts[b]}")
        if (b in queued) != (pool.ref_counts[b] == 0):
            fail("POOL-2", f"block {b}: queued={b in queued} ref={pool.ref_counts[b]}")
    usage = 0.0 if n == 1 else 1 - len(queue) / (n - 1)
    if pool.get_num_free_blocks() != len(queue) or pool.get_usage() != usage:
        fail("POOL-4", f"free count {pool.get_num_free_blocks()} or usage {pool.get_usage()} "
                       f"disagrees with the queue's {len(queue)} blocks")
    seen: set[int] = set()
    if len(pool.dup_by_group) != len(pool.cached_by_group):
        fail("CACHE-1", f"{len(pool.dup_by_group)} duplicate tables for {len(pool.cached_by_group)} groups")
    for group_id, table in enumerate(pool.cached_by_group):
        dups = pool.dup_by_group[group_id]
        for block_hash, later in dups.items():
            if not later or block_hash not in table:
                fail("CACHE-1", f"map entry {block_hash.hex()} lists later holders {later} "
                                f"{'but no first one' if later else 'that are none'}")
        for block_hash, first in table.items():
            ids = [first, *dups.get(block_hash, ())]
            if len(set(ids)) != len(ids):
                fail("CACHE-1", f"map entry {block_hash.hex()} holds {ids}")
            for b in ids:
                if pool.block_hashes[b] != block_hash or pool.block_group_ids[b] != group_id:
                    fail("CACHE-1", f"block {b} in map under another key")
                seen.add(b)
    for b in range(n):
        if pool.block_hashes[b] is not None and not 0 <= pool.block_group_ids[b] < pool.num_groups:
            fail("CACHE-3", f"block {b} has group id {pool.block_group_ids[b]}")
        if pool.block_hashes[b] is not None and b not in seen:
            fail("CACHE-1", f"block {b} hashed but not in the map")
        if pool.block_hashes[b] is None and pool.block_group_ids[b] != -1:
            fail("CACHE-1", f"block {b} carries no hash but group id {pool.block_group_ids[b]}")
    if not pool.enable_caching and seen:
        fail("CACHE-2", "caching disabled but blocks carry hashes")
    if not pool.enable_kv_cache_events and pool.pending_events:
        fail("EVT-1", "events disabled but events pending")


def check_request_invariants(pool: BlockPool, coordinator: KVCacheCoordinator,
                             snapshot: Callable[[], object]) -> None:
    """Check the request table's invariants over the coordinator (the
    manager's ``check_invariants()`` calls it after the pool's): REQ-1..6,
    SKIP-1 (a), XATTN-1, SINK-1, MAMBA-2 and MPART-2. Cost:
    O(num_blocks + blocks held + states cached this step + partial hits).

    Raises:
        InvariantViolation: the message starts with the invariant's ID.
    """
    # Imported late: these modules import the pool, which imports this one.
    from pagedkv.optimized.groups.cross_attention import CrossAttentionManager
    from pagedkv.optimized.groups.dcp_partial import FullAttentionSubBlockManager
    from pagedkv.optimized.groups.mamba import MambaManager
    from pagedkv.optimized.groups.ring import RingManager
    from pagedkv.optimized.groups.rswa import RSWAManager
    from pagedkv.optimized.groups.single_type import FullAttentionManager, SinkFullAttentionManager
    from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager

    holders = [0] * pool.num_blocks
    reserved = set(pool.reserved)
    managers = coordinator.managers

    def fail(inv: str, what: str) -> None:
        raise InvariantViolation(f"{inv}: {what}\nstate: {snapshot()!r}")

    # REQ-5 first: the loops below (and the manager's snapshot) read every
    # known request's lists, so its report shows the pool alone.
    for manager in managers:
        if set(manager.req_to_blocks) != coordinator.requests:
            raise InvariantViolation(
                f"REQ-5: group {manager.group_id} tracks {sorted(manager.req_to_blocks)}, known requests "
                f"are {sorted(coordinator.requests)}\nstate: {pool.snapshot()!r}")
    for request_id in coordinator.requests:
        lists = coordinator.get_blocks(request_id)
        cached_counts = coordinator.get_num_cached_blocks(request_id)
        if len(lists) != len(managers) or len(cached_counts) != len(managers):
            fail("REQ-5", f"request {request_id!r} has {len(lists)} lists for {len(managers)} groups")
        everywhere: list[int] = []
        for group_id, (manager, blocks) in enumerate(zip(managers, lists)):
            cached = cached_counts[group_id]
            if not 0 <= cached <= len(blocks):
                fail("REQ-2", f"request {request_id!r} group {group_id}: {cached} cached of {len(blocks)}")
            held = [block for block in blocks if block]
            if isinstance(manager, RSWAManager):
                if len(set(held)) != len(held):  # nulls only where the gap was released
                    fail("RSWA-1", f"request {request_id!r} group {group_id} holds a block twice: {blocks}")
            elif isinstance(manager, FullAttentionManager) and (
                    len(held) != len(blocks) or len(set(held)) != len(held)):
                fail("REQ-4", f"request {request_id!r} group {group_id}: {blocks}")
            if isinstance(manager, (SlidingWindowManager, ChunkedLocalAttentionManager)) and (
                    list(blocks[len(blocks) - len(held):]) != held or len(set(held)) != len(held)):
                fail("SKIP-1", f"request {request_id!r} group {group_id} holds {blocks}: "
                               "not a null prefix then distinct real blocks")
            if isinstance(manager, RingManager) and (len(held) != len(blocks) or len(held) > 1 or any(
                    pool.cache_key(block) is not None for block in held)):
                fail("RING-1", f"request {request_id!r} ring group {group_id} holds {blocks}")
            for block in held:
                holders[block] += 1
                key = pool.cache_key(block)
                if key is None:
                    continue
                if isinstance(manager, CrossAttentionManager):
                    fail("XATTN-1", f"request {request_id!r} holds hashed cross-attention block {block}")
                if int.from_bytes(key[-4:], "big") != group_id:
                    fail("REQ-3", f"block {block} held in group {group_id} keyed {key.hex()}")
            everywhere.extend(held)
        if len(set(everywhere)) != len(everywhere) or reserved.intersection(everywhere):
            fail("REQ-6", f"request {request_id!r} holds a block twice or a sink block: {everywhere}")
    sink_blocks: list[int] = []
    for manager in managers:
        if isinstance(manager, SinkFullAttentionManager):
            sinks = list(manager.sink_blocks)
            sink_len = getattr(manager.kv_cache_spec, "sink_len", None) or 0
            sink_blocks.extend(sinks)
            if len(sinks) != sink_len // manager.block_size or len(set(sinks)) != len(sinks) or any(
                    pool.ref_counts[block] != 1 or pool.block_hashes[block] is not None
                    or not 0 < block < pool.num_blocks for block in sinks):
                fail("SINK-1", f"group {manager.group_id}'s sink blocks {sinks} are not held as reserved")
        if isinstance(manager, MambaManager):
            _check_states_cached_this_step(pool, manager.group_id, manager.cached_this_step, fail,
                                           partial_keys=manager.partial_hits)
        if isinstance(manager, (MambaManager, FullAttentionSubBlockManager)):
            for request_id, (column, source) in manager.partial_hit.items():
                held = manager.req_to_blocks.get(request_id, [])
                if not 0 <= column < len(held) or held[column] != source or not source:
                    fail("MPART-2", f"request {request_id!r} group {manager.group_id}: partial hit "
                                    f"({column}, {source}) is not a real block it holds there")
    if sorted(sink_blocks) != sorted(pool.reserved):
        fail("SINK-1", f"reserved blocks {sorted(pool.reserved)} != sink blocks {sorted(sink_blocks)}")
    for block in pool.reserved:
        holders[block] += 1  # sink blocks: held by the manager itself (SINK-1)
    # MPART-3: copy endpoints, queued or taken and unreleased, hold one reference each.
    for block, times in coordinator.retained.items():
        holders[block] += times
    for manager in managers:
        if isinstance(manager, (MambaManager, FullAttentionSubBlockManager)):
            for pair in manager.copies:
                for block in pair:
                    holders[block] += 1
    for block in range(1, pool.num_blocks):
        if pool.ref_counts[block] != holders[block]:
            fail("REQ-1", f"block {block}: ref {pool.ref_counts[block]}, held {holders[block]}")


def _check_states_cached_this_step(pool: BlockPool, group_id: int, cached_this_step: set[BlockHash],
                                   fail: Callable[[str, str], None], *, partial_keys: bool = False) -> None:
    """MAMBA-2 in this representation: the set holds raw hashes of the
    group's own view, the group id being implied by the manager. A key of
    the group (or of another one: raw hash plus group id) differs in length
    from every hash the group's blocks carry. With sub-block hits a
    partial key (one hash-block hash) is a second valid length (MPART-1)."""
    lengths = {len(block_hash) for block_hash in cached_this_step}
    lengths.update(len(block_hash) for block_hash in pool.cached_by_group[group_id])
    if len(lengths) > 1 + partial_keys or any(type(block_hash) is not bytes for block_hash in cached_this_step):
        fail("MAMBA-2", f"group {group_id} remembers a state that is not a hash of its view: "
                        f"{sorted(block_hash.hex() for block_hash in cached_this_step)}")
