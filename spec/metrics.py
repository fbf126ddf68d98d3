"""Prefix-cache hit rate over the most recent requests."""

from __future__ import annotations

from collections import deque

from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.types import PrefixCacheStats

__all__ = ["PrefixCachingMetrics"]


class PrefixCachingMetrics:
    """Aggregates :class:`PrefixCacheStats` intervals into a hit rate.

    Semantic model: a queue of intervals ``(requests, queries, hits)``; the
    hit rate is total hits over total queries of the queued intervals. Once
    the queued intervals hold more than ``max_recent_requests`` requests, the
    oldest interval is dropped (one per observation). An interval whose
    ``reset`` flag is set empties the queue before it is added.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        if type(max_recent_requests) is not int or max_recent_requests <= 0:
            raise InvalidArgumentError(
                f"max_recent_requests must be a positive int, got {max_recent_requests!r}")
        self.window_requests = max_recent_requests
        self._intervals: deque[tuple[int, int, int]] = deque()
        self.num_requests = 0
        self.num_queries = 0
        self.num_hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        """Add one interval of lookups (first-time lookups only)."""
        if stats.reset:
            self.reset()
        self._intervals.append((stats.requests, stats.queries, stats.hits))
        self.num_requests += stats.requests
        self.num_queries += stats.queries
        self.num_hits += stats.hits
        if self.num_requests > self.window_requests:
            requests, queries, hits = self._intervals.popleft()
            self.num_requests -= requests
            self.num_queries -= queries
            self.num_hits -= hits

    def reset(self) -> None:
        """Forget every interval."""
        self._intervals.clear()
        self.num_requests = 0
        self.num_queries = 0
        self.num_hits = 0

    @property
    def hit_rate(self) -> float:
        """Hits over queries of the retained intervals; 0.0 with no queries."""
        if self.num_queries == 0:
            return 0.0
        return self.num_hits / self.num_queries
