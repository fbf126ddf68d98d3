"""The facade's upkeep of the prefix cache: keying a request's filled
blocks (``cache_blocks``), dropping hashes by block id, the event queue,
the prefix-cache statistics and the per-step hook (spec/operations.md). A
mixin of :class:`pagedkv.optimized.KVCacheManager`; none of these allocates
or releases a request's blocks. ``reset_prefix_cache`` stays on the facade,
where spec/invariants.md places RESET-4."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator
from pagedkv.optimized.paths.recovery import recover
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.request import RequestFacts, RequestView
from pagedkv.spec.types import KVCacheEvent, PrefixCacheStats

from . import validation

__all__ = ["ManagerCache"]


class ManagerCache:
    """Mixin: needs ``_pool``, ``_coordinator``, ``enable_caching`` and
    ``prefix_cache_stats`` (the facade sets them)."""

    _pool: BlockPool
    enable_caching: bool
    _coordinator: KVCacheCoordinator
    prefix_cache_stats: PrefixCacheStats | None

    def cache_blocks(self, request: RequestView, num_computed_tokens: int) -> None:
        """Cache the request's blocks that ``num_computed_tokens`` tokens
        fill and that are not cached yet. No-op with caching off.

        Cost: O(blocks newly cached).

        Raises:
            UnknownRequestError: the request holds no allocation.
            InvalidTokenCountError: ``num_computed_tokens`` is negative.
            InvalidArgumentError: more full blocks than the request holds
                blocks or block hashes.
        """
        if not self.enable_caching:
            return
        request = RequestFacts.capture(request)
        validation.cache_blocks_args(coordinator=self._coordinator, request=request,
                                     num_computed_tokens=num_computed_tokens)
        try:
            self._coordinator.cache_blocks(request=request, request_id=request.request_id,
                                           num_tokens=num_computed_tokens)
        except BaseException:
            recover(self._coordinator)
            raise

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of the given blocks (see ``BlockPool.evict_blocks``).

        Cost: O(len(block_ids)).

        Raises:
            InvalidArgumentError: ``block_ids`` is not iterable.
            UnknownBlockError: an id outside ``[0, num_blocks)`` (no change).
        """
        try:
            ids = list(block_ids)
        except TypeError:
            raise InvalidArgumentError(f"block_ids must be an iterable of block ids, got {block_ids!r}") from None
        try:
            self._pool.evict_blocks(ids)
        except BaseException:
            recover(self._coordinator)
            raise

    def take_events(self) -> list[KVCacheEvent]:
        """Pending events, oldest first; empties the queue. Cost: O(1)."""
        return self._pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (replaced by fresh ones), or None
        without log_stats. Cost: O(1)."""
        stats = self.prefix_cache_stats
        if stats is None:
            return None
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def new_step_starts(self) -> None:
        """Per-step hook (no-op for full attention). Cost: O(groups)."""
        self._coordinator.new_step_starts()
