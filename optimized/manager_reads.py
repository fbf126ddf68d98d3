"""The facade's read-only operations: a request's blocks, the common
prefix, the observable snapshot and the invariant check (spec/state.md,
spec/operations.md). A mixin of :class:`pagedkv.optimized.KVCacheManager`;
nothing here changes state."""

from __future__ import annotations

import dataclasses

from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.spec.snapshot import ManagerSnapshot, RequestSnapshot
from pagedkv.spec.types import PrefixCacheStats

from . import validation

__all__ = ["ManagerReads"]


class ManagerReads:
    """Mixin: needs ``_pool``, ``_coordinator`` and ``prefix_cache_stats``
    (the facade sets them)."""

    _pool: BlockPool
    _coordinator: KVCacheCoordinator
    prefix_cache_stats: PrefixCacheStats | None

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, the leading blocks of the request that every known
        request holds.

        Cost: O(groups + common blocks).

        Raises:
            UnknownRequestError: the request holds no allocation.
        """
        validation.known(self._coordinator, request_id)
        return self._coordinator.get_num_common_prefix_blocks(request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (a copy).

        Cost: O(blocks held).

        Raises:
            UnknownRequestError: the request holds no allocation.
        """
        validation.known(self._coordinator, request_id)
        return KVCacheBlocks(
            tuple([list(group) for group in self._coordinator.get_blocks(request_id)]),
            self._pool.block_hashes)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (fresh lists).

        Cost: O(blocks held).

        Raises:
            UnknownRequestError: the request holds no allocation.
        """
        validation.known(self._coordinator, request_id)
        return tuple([list(group) for group in self._coordinator.get_blocks(request_id)])

    def snapshot(self) -> ManagerSnapshot:
        """Observable state: pool, known requests sorted by id, a copy of the
        stats. Cost: O(num_blocks + blocks held + cached keys * log)."""
        coordinator = self._coordinator
        requests = tuple(
            RequestSnapshot(
                request_id=request_id,
                block_ids=tuple(tuple(group) for group in coordinator.get_blocks(request_id)),
                num_cached_blocks=coordinator.get_num_cached_blocks(request_id),
            )
            for request_id in sorted(coordinator.requests))
        stats = self.prefix_cache_stats
        return ManagerSnapshot(
            pool=self._pool.snapshot(),
            requests=requests,
            prefix_cache_stats=None if stats is None else dataclasses.replace(stats),
        )

    def check_invariants(self) -> None:
        """Check the pool invariants (``PoolView.check_invariants``), then the
        request invariants (``KVCacheCoordinator.check_request_invariants``). Cost: O(num_blocks + blocks held).

        Raises:
            InvariantViolation: the message starts with the invariant's ID.
        """
        self._pool.check_invariants()
        self._coordinator.check_request_invariants(self.snapshot)
