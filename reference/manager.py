"""The facade an engine's scheduler calls (spec/operations.md,
"KVCacheManager"). Each method validates everything first, so a refused
call changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pagedkv.reference import rules, validation
from pagedkv.reference.block_pool import KVCacheBlocks
from pagedkv.reference.coordinator import KVCacheCoordinator
from pagedkv.reference.features.enabled import FEATURES, FeatureOperations, RetentionOperations, make_pool, recover
from pagedkv.reference.hasher import make_block_hasher
from pagedkv.reference.invariants import check_manager
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hashing import normalize_hash_fn
from pagedkv.spec.manager_args import check_manager_args
from pagedkv.spec.request import Request, RequestFacts, RequestView, check_request_options
from pagedkv.spec.snapshot import ManagerSnapshot, RequestSnapshot
from pagedkv.spec.stored_events import PER_CALL
from pagedkv.spec.types import KVCacheEvent, PrefixCacheStats

__all__ = ["KVCacheManager"]


class KVCacheManager(FeatureOperations, RetentionOperations):
    """Allocates, caches and frees the KV cache blocks of requests. The
    arguments are those of spec/operations.md, "KVCacheManager", checked by
    ``pagedkv.spec.manager_args``. The facade builds the pool; the
    coordinator builds the per-group managers over it, holds the state and
    plugs in the features (``FEATURES``, spec/managers.md §9), whose own
    operations this class inherits from ``FeatureOperations``."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, *, enable_caching: bool = True,
                 hash_fn: str = "sha256", hash_block_size: int | None = None, use_eagle: bool = False,
                 log_stats: bool = False, enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, hash_seed: str | None = None, retention_interval: int | None = None,
                 max_num_batched_tokens: int | None = None, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0, block_stored_events: str = PER_CALL, retention: Any = None) -> None:
        self.block_sizes, hash_block_size = check_manager_args(
            kv_cache_config=kv_cache_config, max_model_len=max_model_len, hash_fn=hash_fn,
            hash_block_size=hash_block_size, dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
            retention_interval=retention_interval, max_num_batched_tokens=max_num_batched_tokens,
            hash_seed=hash_seed, num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead)
        self.kv_cache_config, self.max_model_len, self.hash_block_size = kv_cache_config, max_model_len, hash_block_size
        self.enable_caching, self.use_eagle, self.log_stats = enable_caching, use_eagle, log_stats
        self.hash_fn, self.hash_seed = normalize_hash_fn(hash_fn), hash_seed
        self.num_hash_lookahead_tokens, self.num_prefill_lookahead = num_hash_lookahead_tokens, num_prefill_lookahead
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        self.block_pool = make_pool(retention, kv_cache_config.num_blocks, enable_caching,  # retention: opt-in
                                    num_groups=len(self.block_sizes), enable_kv_cache_events=enable_kv_cache_events,
                                    block_stored_events=block_stored_events)
        self.coordinator = KVCacheCoordinator(
            kv_cache_config, self.block_pool, self.block_sizes, hash_block_size or 1, enable_caching, use_eagle,
            retention_interval, max_model_len, self.max_num_batched_tokens, FEATURES)
        # Events carry the lookahead tokens (spec/hashing.md §7); re-prefilled tokens are never cached (D-HASH-12).
        self.block_pool.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.coordinator.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], **extra: Any) -> Request:
        """A :class:`Request` hashed as this manager hashes. Raises
        ``InvalidArgumentError`` as ``Request`` does, or for a live request's id (D-API-22)."""
        check_request_options(extra)
        hasher = None if self.hash_block_size is None else make_block_hasher(
            self.hash_fn, self.hash_block_size, self.hash_seed, self.num_hash_lookahead_tokens)
        request = Request(request_id, prompt_token_ids, block_hasher=hasher, **extra)
        if request_id in self.coordinator.known:
            raise InvalidArgumentError(
                f"request_id {request_id!r} belongs to a live request (allocated, not freed) (D-API-22)")
        return request

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: RequestView) -> tuple[KVCacheBlocks, int]:
        """The blocks of the longest prefix hit and its length (LOOKUP-1..6). Pure."""
        request = RequestFacts.capture(request)
        if not self.enable_caching or request.skip_reading_prefix_cache or not self.coordinator.managers:
            return KVCacheBlocks([[] for _ in self.coordinator.managers]), 0  # LOOKUP-1
        max_length = rules.max_hit_tokens(validation.count("request.num_tokens", request.num_tokens, 1))  # LOOKUP-2
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)  # LOOKUP-3, 4
        if self.prefix_cache_stats is not None:  # LOOKUP-5
            self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hit_tokens,
                                           preempted=request.num_preemptions > 0)
        return KVCacheBlocks(hits), num_hit_tokens  # LOOKUP-6: nothing else changed

    def allocate_slots(self, request: RequestView, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       num_in_flight_tokens: int = 0, watermark_blocks: int = 0) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens (plus lookahead), taking
        the hit of ``get_computed_blocks``: the new blocks, or ``None`` when
        the pool cannot supply them (ALLOC-1..9; the arguments:
        spec/operations.md, "allocate_slots"). Raises ``InvalidTokenCountError``,
        ``InvalidArgumentError``, ``UnknownBlockError``, ``ExceedsMaxModelLenError``."""
        # The engine's object is read once, before any change ("Exception safety").
        request = RequestFacts.capture(request)
        request_id, coordinator = request.request_id, self.coordinator
        known = request_id in coordinator.known
        hits = validation.allocate_args(  # ALLOC-1: validate, all before any change.
            coordinator=coordinator, request=request, known_request=known, max_model_len=self.max_model_len,
            num_new_tokens=num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
            new_computed_blocks=new_computed_blocks, num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens, num_encoder_tokens=num_encoder_tokens,
            reserved_blocks=reserved_blocks, num_in_flight_tokens=num_in_flight_tokens,
            watermark_blocks=watermark_blocks)
        # ALLOC-2: token counts; lookahead capped (D-API-3).
        local = request.num_computed_tokens + num_new_computed_tokens
        total = local + num_external_computed_tokens
        main = total + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        with self._changing():
            # ALLOC-3: released even if the allocation is refused (D-API-6), on the settled basis (D-API-14).
            for manager in coordinator.managers:
                manager.remove_skipped_blocks(request_id, max(0, total - num_in_flight_tokens),
                                              request.num_prompt_tokens)
            # ALLOC-4, ALLOC-5: capacity, the features' step blocks included (H5).
            demand = coordinator.get_num_blocks_to_allocate(request_id, need, hits, total, main, num_encoder_tokens,
                                                            num_external_computed_tokens)
            demand += coordinator.step_blocks(request, request_id, total, main, reserve=False)
            # The step keeps reserved_blocks and the watermark free; the whole
            # request (full_sequence_must_fit, §8) the watermark (D-API-13, D-API-48).
            free = self.block_pool.get_num_free_blocks()
            if demand + reserved_blocks + watermark_blocks > free:
                return None
            whole = min(request.num_tokens + num_lookahead_tokens, self.max_model_len)
            if full_sequence_must_fit and coordinator.full_sequence_demand(
                    request_id, whole, hits, num_encoder_tokens) + watermark_blocks > free:
                return None
            if not known:  # ALLOC-6
                coordinator.admit(request_id, hits, local, num_external_computed_tokens)
            coordinator.step_blocks(request, request_id, total, main, reserve=True)  # ALLOC-7
            new_blocks = coordinator.allocate_new_blocks(request_id, need, main, num_encoder_tokens)
            if self.enable_caching and not delay_cache_blocks:  # ALLOC-8: lookahead tokens never
                coordinator.cache_blocks(request, request_id, min(main, request.num_tokens))
            return KVCacheBlocks(new_blocks)  # ALLOC-9

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """A change; an exception leaves the manager consistent (D-API-24)."""
        try:
            yield
        except BaseException:
            recover(self.coordinator)
            raise

    def free(self, request: RequestView, *, missing_ok: bool = False) -> None:
        """FREE-1..6: release every block of the request, tail first. Raises
        ``UnknownRequestError`` if it holds no allocation (unless ``missing_ok``)."""
        try:
            request_id = request.request_id
        except AttributeError:
            raise InvalidArgumentError(f"request must have the attributes of RequestView, got {request!r}") from None
        if missing_ok:
            try:
                if request_id not in self.coordinator.known:
                    return
            except TypeError:
                pass  # validation.known names the bad id
        validation.known(self.coordinator, request_id)  # FREE-1
        with self._changing():
            self.coordinator.release(request_id)  # FREE-2..6

    def cache_blocks(self, request: RequestView, num_computed_tokens: int) -> None:
        """Key the full blocks among the first ``num_computed_tokens`` tokens."""
        if not self.enable_caching:
            return
        request = RequestFacts.capture(request)
        validation.cache_blocks_args(self.coordinator, request, num_computed_tokens)
        with self._changing():
            self.coordinator.cache_blocks(request, request.request_id, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache keys of the given blocks. Raises ``InvalidArgumentError``
        (not iterable), ``UnknownBlockError`` (an id outside ``[0, num_blocks)``; no change)."""
        try:
            ids = list(block_ids)
        except TypeError:
            raise InvalidArgumentError(f"block_ids must be an iterable of block ids, got {block_ids!r}") from None
        with self._changing():
            self.block_pool.evict_blocks(ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every cache key if no block is in use; ``False`` otherwise."""
        with self._changing():
            reset = self.block_pool.reset_prefix_cache()
        if reset and self.prefix_cache_stats is not None:  # RESET-4
            self.prefix_cache_stats.reset = True
        return reset

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, the leading blocks of ``request_id`` every known request holds."""
        validation.known(self.coordinator, request_id)
        return [manager.get_num_common_prefix_blocks(request_id) for manager in self.coordinator.managers]

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group."""
        validation.known(self.coordinator, request_id)
        return KVCacheBlocks([manager.req_to_blocks[request_id] for manager in self.coordinator.managers])

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        return self.get_blocks(request_id).get_block_ids()

    def take_events(self) -> list[KVCacheEvent]:
        """Pending KV cache events, oldest first; emptied."""
        return self.block_pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics since the last call (then reset), or ``None`` without ``log_stats``."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def new_step_starts(self) -> None:
        """A scheduler step begins (MAMBA-2)."""
        with self._changing():
            for manager in self.coordinator.managers:
                manager.new_step_starts()

    def snapshot(self) -> ManagerSnapshot:
        """Observable state (spec/state.md)."""
        managers = self.coordinator.managers
        requests = tuple(RequestSnapshot(
            request_id=request_id, block_ids=tuple(tuple(block.block_id for block in manager.req_to_blocks[request_id])
                                                   for manager in managers),
            num_cached_blocks=tuple(manager.num_cached_blocks[request_id] for manager in managers))
            for request_id in sorted(self.coordinator.known))
        stats = None if self.prefix_cache_stats is None else dataclasses.replace(self.prefix_cache_stats)
        return ManagerSnapshot(pool=self.block_pool.snapshot(), requests=requests, prefix_cache_stats=stats)

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` naming the first broken invariant (spec/invariants.md)."""
        check_manager(self)
