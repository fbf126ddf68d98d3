"""The KV cache manager facade (spec/operations.md, "KVCacheManager").

What an engine's scheduler calls. Each public method validates everything
first and raises a typed error before touching state, so a refused call
leaves the manager exactly as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.blocks import KVCacheBlocks
from pagedkv.reference.coordinator import make_coordinator
from pagedkv.reference.cross_attention import CrossAttentionManager
from pagedkv.reference.hasher import make_block_hasher
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTokenCountError,
    UnknownRequestError,
)
from pagedkv.spec.hashing import normalize_hash_fn
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.request import Request, RequestView
from pagedkv.spec.snapshot import ManagerSnapshot, RequestSnapshot
from pagedkv.spec.types import KVCacheEvent, PrefixCacheStats

__all__ = ["KVCacheManager"]


def _check_count(name: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidTokenCountError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class KVCacheManager:
    """Allocates, caches and frees the KV cache blocks of requests.

    ``kv_cache_config`` gives the pool size and the groups; ``max_model_len``
    bounds every request. ``hash_fn`` names the block hash
    (spec/hashing.md); ``hash_block_size`` must divide every group's block size (``None`` picks it).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, *,
                 enable_caching: bool = True, hash_fn: str = "sha256",
                 hash_block_size: int | None = None, use_eagle: bool = False,
                 log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1,
                 hash_seed: str | None = None, retention_interval: int | None = None,
                 max_num_batched_tokens: int | None = None) -> None:
        if type(max_model_len) is not int or max_model_len < 1:
            raise InvalidConfigError(f"max_model_len must be a positive int, got {max_model_len!r}")
        for name, size in (("dcp_world_size", dcp_world_size), ("pcp_world_size", pcp_world_size)):
            if type(size) is not int or size < 1:
                raise InvalidConfigError(f"{name} must be a positive int, got {size!r}")
        groups = kv_cache_config.kv_cache_groups
        if dcp_world_size * pcp_world_size > 1:
            for group_id, group in enumerate(groups):
                if manager_kind_for(group.kv_cache_spec) not in ("full_attention", "sink_full_attention"):
                    raise InvalidConfigError(
                        f"kv_cache_groups[{group_id}]: context parallelism supports full attention only, "
                        f"got {type(group.kv_cache_spec).__name__}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.hash_fn = normalize_hash_fn(hash_fn)
        self.block_sizes = [group.kv_cache_spec.block_size * dcp_world_size * pcp_world_size for group in groups]
        if hash_block_size is None and self.block_sizes:
            hash_block_size = rules.hash_block_size(self.block_sizes)
        if hash_block_size is not None and (type(hash_block_size) is not int or hash_block_size < 1 or any(
                size % hash_block_size for size in self.block_sizes)):
            raise InvalidConfigError(
                f"hash_block_size must be a positive int dividing every group's block size "
                f"{self.block_sizes}, got {hash_block_size!r}")
        alignment = rules.hit_alignment(self.block_sizes)
        if retention_interval is not None and (type(retention_interval) is not int or retention_interval < 0
                                               or retention_interval % alignment):
            raise InvalidConfigError(
                f"retention_interval must be None, 0 or a positive multiple of the hit alignment "
                f"{alignment}, got {retention_interval!r}")
        if max_num_batched_tokens is not None and (type(max_num_batched_tokens) is not int
                                                   or max_num_batched_tokens < 1):
            raise InvalidConfigError(
                f"max_num_batched_tokens must be a positive int or None, got {max_num_batched_tokens!r}")
        # The same cap startup sizing counts per request (spec CFG-7, CFG-8).
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        admission_caps: list[int | None] = []
        for group in groups:
            spec = group.kv_cache_spec
            admission_caps.append(spec.max_admission_blocks_per_request(self.max_num_batched_tokens, max_model_len)
                                  if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) else None)
        self.hash_block_size = hash_block_size
        self.hash_seed = hash_seed
        self._pool = BlockPool(kv_cache_config.num_blocks, enable_caching,
                               enable_kv_cache_events=enable_kv_cache_events)
        self.coordinator = make_coordinator(kv_cache_config, self._pool, enable_caching, self.block_sizes,
                                            hash_block_size or 1, use_eagle, retention_interval,
                                            admission_caps)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    # -- requests -------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], **extra: Any) -> Request:
        """A :class:`Request` whose block hashes follow this manager's hashing."""
        hasher = None if self.hash_block_size is None else make_block_hasher(
            self.hash_fn, self.hash_block_size, self.hash_seed)
        return Request(request_id, prompt_token_ids, block_hasher=hasher, **extra)

    @property
    def block_pool(self) -> BlockPool:
        """The shared block pool."""
        return self._pool

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self._pool.get_usage()

    # -- the scheduler's calls -------------------------------------------------

    def get_computed_blocks(self, request: RequestView) -> tuple[KVCacheBlocks, int]:
        """The cached blocks of the longest prefix hit and its length in tokens.

        Pure: nothing is reserved (``allocate_slots`` takes the hit). The hit
        stops at least one token short of the request's end.
        """
        empty = KVCacheBlocks([[] for _ in self.coordinator.managers])
        if not self.enable_caching or request.skip_reading_prefix_cache or not self.coordinator.managers:
            return empty, 0
        max_length = rules.max_hit_tokens(_check_count("request.num_tokens", request.num_tokens, 1))
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hit_tokens,
                                           preempted=request.num_preemptions > 0)
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(self, request: RequestView, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens (plus
        lookahead), taking the hit blocks of ``get_computed_blocks``.

        Returns the newly allocated blocks, or ``None`` (and no change beyond
        releasing blocks attention no longer reads, D-API-6) when the pool
        cannot supply them. With ``full_sequence_must_fit`` the whole request
        (all its tokens, windowed groups at their admission cap) must fit too,
        so an engine admitting by that rule and startup sizing agree
        (spec/managers.md §8).

        Raises:
            InvalidTokenCountError, InvalidArgumentError, ExceedsMaxModelLenError.
        """
        request_id = request.request_id
        _check_count("num_new_tokens", num_new_tokens, 1)
        for name, value in (("num_new_computed_tokens", num_new_computed_tokens),
                            ("num_lookahead_tokens", num_lookahead_tokens),
                            ("num_external_computed_tokens", num_external_computed_tokens),
                            ("num_encoder_tokens", num_encoder_tokens),
                            ("request.num_computed_tokens", request.num_computed_tokens)):
            _check_count(name, value, 0)
        num_groups = len(self.coordinator.managers)
        hits: tuple[tuple[KVCacheBlock, ...], ...] = tuple(() for _ in range(num_groups))
        if new_computed_blocks is not None:
            if not isinstance(new_computed_blocks, KVCacheBlocks) or len(new_computed_blocks.blocks) != num_groups:
                raise InvalidArgumentError(
                    f"new_computed_blocks must be this manager's KVCacheBlocks with {num_groups} groups")
            hits = new_computed_blocks.blocks
        known = request_id in self.coordinator.known
        if known and (num_new_computed_tokens or any(hits)):
            raise InvalidArgumentError(
                f"request {request_id!r} already holds blocks: it cannot take new prefix hits")
        if not self.enable_caching and (num_new_computed_tokens or any(hits)):
            raise InvalidArgumentError("prefix caching is disabled: no computed blocks can be passed")
        for manager, group_hits in zip(self.coordinator.managers, hits):
            expected = (0 if isinstance(manager, CrossAttentionManager)
                        else num_new_computed_tokens // manager.block_size)
            if num_new_computed_tokens % manager.block_size or len(group_hits) != expected:
                raise InvalidArgumentError(
                    f"num_new_computed_tokens={num_new_computed_tokens} does not match the "
                    f"{len(group_hits)} computed blocks of group {manager.group_id} "
                    f"(block size {manager.block_size})")
        if num_groups == 0 and num_new_computed_tokens:
            raise InvalidArgumentError("a model without KV cache groups has no computed blocks")
        if any(hits):
            stale = self.coordinator.stale_hit(request.block_hashes, hits)
            if stale is not None:
                raise InvalidArgumentError(f"request {request_id!r}: stale new_computed_blocks: {stale}")
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total_computed = num_local_computed + num_external_computed_tokens
        num_main_tokens = num_total_computed + num_new_tokens
        if num_main_tokens > self.max_model_len:
            raise ExceedsMaxModelLenError(
                f"request {request_id!r} would hold {num_main_tokens} tokens "
                f"({num_total_computed} computed + {num_new_tokens} new), "
                f"more than max_model_len={self.max_model_len}")
        num_tokens_to_cache = min(num_main_tokens, request.num_tokens)
        caching_now = self.enable_caching and not delay_cache_blocks
        if caching_now and self.hash_block_size is not None and (
                len(request.block_hashes) < num_tokens_to_cache // self.hash_block_size):
            raise InvalidArgumentError(
                f"request {request_id!r} has {len(request.block_hashes)} block hashes, needs "
                f"{num_tokens_to_cache // self.hash_block_size} to cache its full blocks")
        num_tokens_need_slot = min(num_main_tokens + num_lookahead_tokens, self.max_model_len)

        # Blocks attention no longer reads are released even if the
        # allocation is then refused: they are dead weight either way, and
        # releasing them first spares cached blocks from eviction (D-API-6).
        self.coordinator.remove_skipped_blocks(request_id, num_total_computed)
        needed = self.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hits, num_total_computed, num_main_tokens, num_encoder_tokens,
            num_external_computed_tokens)
        if full_sequence_must_fit:
            whole = min(request.num_tokens + num_lookahead_tokens, self.max_model_len)
            needed = max(needed, self.coordinator.full_sequence_demand(request_id, whole, hits,
                                                                       num_encoder_tokens))
        if needed > self._pool.get_num_free_blocks():
            return None
        if not known:
            self.coordinator.admit(request_id, hits, num_local_computed, num_external_computed_tokens)
        new_blocks = self.coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_main_tokens, num_encoder_tokens)
        if caching_now:
            self.coordinator.cache_blocks(request, request_id, num_tokens_to_cache)
        return KVCacheBlocks(new_blocks)

    def free(self, request: RequestView, *, missing_ok: bool = False) -> None:
        """Release every block of the request, tail first.

        Raises:
            UnknownRequestError: the request holds no allocation (unless
                ``missing_ok``, for engines aborting unadmitted requests).
        """
        if request.request_id not in self.coordinator.known:
            if missing_ok:
                return
            raise UnknownRequestError(
                f"request {request.request_id!r} holds no blocks (never allocated or already freed)")
        self.coordinator.release(request.request_id)

    def cache_blocks(self, request: RequestView, num_computed_tokens: int) -> None:
        """Hand the full blocks among the first ``num_computed_tokens`` tokens
        to the prefix cache (no-op with caching off)."""
        if not self.enable_caching:
            return
        self._check_known(request.request_id)
        _check_count("num_computed_tokens", num_computed_tokens, 0)
        for manager in self.coordinator.managers:
            if isinstance(manager, CrossAttentionManager):
                continue
            num_full = num_computed_tokens // manager.block_size
            held = len(manager.req_to_blocks[request.request_id])
            hashes = len(request.block_hashes) * (self.hash_block_size or 1) // manager.block_size
            if num_full > held or num_full > hashes:
                raise InvalidArgumentError(
                    f"cannot cache {num_full} full blocks of request {request.request_id!r} in group "
                    f"{manager.group_id}: it holds {held} blocks and hashes for {hashes}")
        self.coordinator.cache_blocks(request, request.request_id, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache keys of the given blocks (spec: evict_blocks)."""
        self._pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every cache key if no block is in use; ``False`` otherwise."""
        if not self._pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, the leading blocks of ``request_id`` every known request holds."""
        self._check_known(request_id)
        return self.coordinator.get_num_common_prefix_blocks(request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group."""
        self._check_known(request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        return self.get_blocks(request_id).get_block_ids()

    def take_events(self) -> list[KVCacheEvent]:
        """Pending KV cache events, oldest first; emptied."""
        return self._pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics since the last call (then reset), or ``None`` without ``log_stats``."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def new_step_starts(self) -> None:
        """A scheduler step begins: Mamba groups may serve states cached in
        the previous step from now on (MAMBA-2)."""
        self.coordinator.new_step_starts()

    # -- observation ------------------------------------------------------------

    def _check_known(self, request_id: str) -> None:
        if request_id not in self.coordinator.known:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks (never allocated or already freed)")

    def snapshot(self) -> ManagerSnapshot:
        """Observable state (spec/state.md)."""
        managers = self.coordinator.managers
        requests = tuple(
            RequestSnapshot(
                request_id=request_id,
                block_ids=tuple(tuple(block.block_id for block in manager.req_to_blocks[request_id])
                                for manager in managers),
                num_cached_blocks=tuple(manager.num_cached_blocks[request_id] for manager in managers),
            )
            for request_id in sorted(self.coordinator.known))
        stats = None if self.prefix_cache_stats is None else dataclasses.replace(self.prefix_cache_stats)
        return ManagerSnapshot(pool=self._pool.snapshot(), requests=requests, prefix_cache_stats=stats)

    def check_invariants(self) -> None:
        """Check every invariant of spec/state.md; raise ``InvariantViolation``
        naming the first broken one's ID, with a state dump."""
        from pagedkv.reference.invariants import check_manager

        check_manager(self)
