"""The coordinator's ``check_invariants``: the request table's invariants of
spec/state.md (REQ-1..6, SKIP-1 (a), XATTN-1, SINK-1, RSWA-1, RING-1, MAMBA-2,
MPART-2), by ID, over the coordinator's groups and the pool they hold blocks of
(the reference's ``reference/invariants.py`` checks the same IDs over its own
representation; the pool's own invariants are ``PoolView.check_invariants``).

A mixin of :class:`~pagedkv.optimized.coordination.coordinator.KVCacheCoordinator`,
the owner of the request table. When everything works these are expensive
no-ops; on failure they raise :class:`~pagedkv.spec.errors.InvariantViolation`
whose message starts with the broken invariant's ID.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from pagedkv.optimized.groups.cross_attention import CrossAttentionManager
from pagedkv.optimized.groups.dcp_partial import FullAttentionSubBlockManager
from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.ring import RingManager
from pagedkv.optimized.groups.rswa import RSWAManager
from pagedkv.optimized.groups.single_type import (
    FullAttentionManager,
    SingleTypeManager,
    SinkFullAttentionManager,
)
from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.spec.errors import InvariantViolation
from pagedkv.spec.types import BlockHash

__all__ = ["CoordinatorChecks"]


class CoordinatorChecks:
    """``check_request_invariants`` for the coordinator (its tables, declared here)."""

    __slots__ = ()

    managers: tuple[SingleTypeManager, ...]
    block_pool: BlockPool
    requests: set[str]
    retained: Counter[int]

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        raise NotImplementedError  # the coordinator's

    def get_num_cached_blocks(self, request_id: str) -> tuple[int, ...]:
        raise NotImplementedError  # the coordinator's

    def check_request_invariants(self, snapshot: Callable[[], object]) -> None:
        """Check the request table's invariants over the coordinator (the
        manager's ``check_invariants()`` calls it after the pool's): REQ-1..6,
        SKIP-1 (a), XATTN-1, SINK-1, MAMBA-2 and MPART-2. Cost:
        O(num_blocks + blocks held + states cached this step + partial hits).

        Raises:
            InvariantViolation: the message starts with the invariant's ID.
        """
        pool, coordinator = self.block_pool, self
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
