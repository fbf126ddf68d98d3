"""Structural invariants of the optimized block pool (spec/state.md IDs).

Kept apart from ``block_pool.py`` so the hot module stays small; the pool's
``check_invariants()`` calls :func:`check_pool_invariants`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedkv.spec.errors import InvariantViolation

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .coordinator import KVCacheCoordinator

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
    if pool.ref_counts[0] != 0 or pool.block_hashes[0] is not None or 0 in queue:
        fail("POOL-1", "null block queued, referenced or hashed")
    queued = set(queue)
    if any(not 0 < b < n for b in queue):
        fail("POOL-2", "free queue holds an id outside [1, num_blocks)")
    for b in range(1, n):
        if pool.ref_counts[b] < 0:
            fail("POOL-3", f"block {b} has ref count {pool.ref_counts[b]}")
        if (b in queued) != (pool.ref_counts[b] == 0):
            fail("POOL-2", f"block {b}: queued={b in queued} ref={pool.ref_counts[b]}")
    if pool.free_queue.size != len(queue):
        fail("POOL-4", f"free count {pool.free_queue.size} != queue length {len(queue)}")
    seen: set[int] = set()
    for group_id, table in enumerate(pool.cached_by_group):
        for block_hash, ids in table.items():
            if not ids or len(set(ids)) != len(ids):
                fail("CACHE-1", f"map entry {block_hash.hex()} holds {ids}")
            for b in ids:
                if pool.block_hashes[b] != block_hash or pool.block_group_ids[b] != group_id:
                    fail("CACHE-1", f"block {b} in map under another key")
                seen.add(b)
    for b in range(n):
        if pool.block_hashes[b] is not None and b not in seen:
            fail("CACHE-1", f"block {b} hashed but not in the map")
        if pool.block_hashes[b] is not None and not 0 <= pool.block_group_ids[b] < pool.num_groups:
            fail("CACHE-3", f"block {b} has group id {pool.block_group_ids[b]}")
    if not pool.enable_caching and seen:
        fail("CACHE-2", "caching disabled but blocks carry hashes")
    if not pool.enable_kv_cache_events and pool.pending_events:
        fail("EVT-1", "events disabled but events pending")


def check_request_invariants(pool: BlockPool, coordinator: KVCacheCoordinator,
                             snapshot: Callable[[], object]) -> None:
    """Check REQ-1..5 over the coordinator's request table (the manager's
    ``check_invariants()`` calls it after the pool's). Cost: O(num_blocks +
    blocks held).

    Raises:
        InvariantViolation: the message starts with the invariant's ID.
    """
    from .single_type import FullAttentionManager  # imported late: it imports the pool

    holders = [0] * pool.num_blocks

    def fail(inv: str, what: str) -> None:
        raise InvariantViolation(f"{inv}: {what}\nstate: {snapshot()!r}")

    for request_id in coordinator.requests:
        for manager in coordinator.managers:
            if request_id not in manager.req_to_blocks:
                fail("REQ-5", f"request {request_id!r} has no list in group {manager.group_id}")
        for group_id, blocks in enumerate(coordinator.get_blocks(request_id)):
            cached = coordinator.get_num_cached_blocks(request_id)[group_id]
            if not 0 <= cached <= len(blocks):
                fail("REQ-2", f"request {request_id!r}: {cached} cached of {len(blocks)}")
            held = [block for block in blocks if block]
            full = isinstance(coordinator.managers[group_id], FullAttentionManager)
            if (full and len(held) != len(blocks)) or len(set(held)) != len(held):
                fail("REQ-4", f"request {request_id!r} group {group_id}: {blocks}")
            for block in held:
                holders[block] += 1
                key = pool.cache_key(block)
                if key is not None and int.from_bytes(key[-4:], "big") != group_id:
                    fail("REQ-3", f"block {block} held in group {group_id} keyed {key.hex()}")
    for manager in coordinator.managers:
        if set(manager.req_to_blocks) != coordinator.requests:
            fail("REQ-5", f"group {manager.group_id} tracks other requests")
    for block in pool.reserved:
        holders[block] += 1  # sink blocks: held by the manager itself (SINK-1)
    for block in range(1, pool.num_blocks):
        if pool.ref_counts[block] != holders[block]:
            fail("REQ-1", f"block {block}: ref {pool.ref_counts[block]}, held {holders[block]}")
