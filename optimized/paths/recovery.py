"""Recovery after an exception interrupted a change (spec/operations.md,
"Exception safety"; D-API-24).

The request lists are the source of truth: every request id any group (or
the coordinator) still tracks is known again, with a list and a cached count
in every group; then the pool rebuilds ref counts, cache map and free queue
from them (:meth:`BlockPool.recover`). Runs only after an exception. The
dicts and lists are changed in place: the decode fast paths hold them.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager

if TYPE_CHECKING:
    from pagedkv.optimized.paths.coordinated import CoordinatorState

__all__ = ["recover"]


def recover(coordinator: CoordinatorState) -> None:
    """Make the manager consistent again: invariants hold, every known
    request can be freed, no block is leaked. Cost: O(num_blocks + blocks held)."""
    managers = coordinator.managers
    known = set(coordinator.requests)
    for manager in managers:
        known.update(manager.req_to_blocks)
        known.update(manager.num_cached_blocks)
    coordinator.requests.update(known)
    reserved = set(coordinator.block_pool.reserved)
    for request_id in known:
        seen: set[int] = set()
        for manager in managers:
            blocks = manager.req_to_blocks.setdefault(request_id, [])
            kept: list[int] = []
            for block in blocks:
                if block and (block in seen or block in reserved):
                    continue  # held twice, or a sink block: dropped (REQ-6)
                seen.add(block)
                kept.append(block)
            if isinstance(manager, (SlidingWindowManager, ChunkedLocalAttentionManager)):
                # Skipping nulls a prefix (SKIP-1): positions before a null
                # were being skipped when the exception came.
                last_null = max((i for i, block in enumerate(kept) if not block), default=0)
                kept[:last_null] = [0] * last_null
            blocks[:] = kept
            cached = manager.num_cached_blocks.get(request_id, 0)
            manager.num_cached_blocks[request_id] = min(max(cached, 0), len(blocks))
    for manager in managers:
        if isinstance(manager, MambaManager):
            for request_id in [r for r in manager.last_state_block if r not in known]:
                del manager.last_state_block[request_id]
            manager.given_state.intersection_update(known)
    holders = Counter(block for manager in managers
                      for blocks in manager.req_to_blocks.values() for block in blocks if block)
    # Copy retentions hold their endpoints too (MPART-3).
    holders.update(coordinator.retained)
    for manager in coordinator.copy_managers:
        holders.update(block for pair in manager.copies for block in pair)
    coordinator.block_pool.recover(holders)
