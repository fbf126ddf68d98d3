"""Observable state, as plain values, for comparing implementations.

Two implementations agree when, after the same calls, their snapshots are
equal. A snapshot holds the pool, each known request's block ids and cached
counts per group, and the stats; nothing an implementation may choose
freely (object identities, internal indexes). The per-type auxiliary state
of spec/state.md (Mamba's bookkeeping, for one) is not in it: it shows only
through later results, which the differential tests compare.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.spec.types import KVCacheEvent, PrefixCacheStats

__all__ = ["PoolSnapshot", "RequestSnapshot", "ManagerSnapshot"]


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """The block pool.

    ``ref_counts[i]`` and ``block_hashes[i]`` describe block ``i`` (the null
    block reads 0 and ``None``); ``block_hashes`` are cache keys (hash with
    group id). ``free_queue`` runs from the front (allocated next) to the
    back. ``cached`` maps each cache key, in sorted key order, to the ids of
    the blocks carrying it, in lookup order (the first is the one a lookup
    returns). ``pending_events`` are the events not yet taken.
    """

    num_blocks: int
    ref_counts: tuple[int, ...]
    block_hashes: tuple[bytes | None, ...]
    free_queue: tuple[int, ...]
    cached: tuple[tuple[bytes, tuple[int, ...]], ...]
    pending_events: tuple[KVCacheEvent, ...]


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """One request's allocation: block ids and cached-block count per group."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_cached_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ManagerSnapshot:
    """The whole manager: pool, requests (sorted by id), pending statistics."""

    pool: PoolSnapshot
    requests: tuple[RequestSnapshot, ...]
    prefix_cache_stats: PrefixCacheStats | None
