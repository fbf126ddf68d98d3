"""Structural invariants of the optimized block pool (spec/state.md IDs).

Kept apart from ``block_pool.py`` so the hot module stays small; the pool's
``check_invariants()`` calls :func:`check_pool_invariants`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.spec.errors import InvariantViolation

if TYPE_CHECKING:
    from .block_pool import BlockPool

__all__ = ["check_pool_invariants"]


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
