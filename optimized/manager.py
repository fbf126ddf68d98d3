"""KVCacheManager: the facade an engine's scheduler calls.

Semantic model (spec/state.md, spec/operations.md): a block pool shared by
the KV cache groups, and for each *known* request (holding an allocation,
from its first successful ``allocate_slots`` until ``free``) a block list
per group plus a count of cached blocks. Requests are read, never owned:
any object with the attributes of :class:`pagedkv.spec.RequestView` works.

Every public method validates first (the constructor with the shared
``pagedkv.spec.manager_args``, the others with ``validation.py``) and raises
a typed error from ``pagedkv.spec.errors`` before changing anything. The facade
builds the pool (spec/operations.md, construction); the state and the work
live in the coordinator (``coordinator.py``), which builds the per-group
managers over that pool. ``allocate_slots`` reads as the spec's
numbered steps; before them, a decode step (no hit, lookahead, external or
encoder tokens) is offered to the coordinator's one decode fast path
(``KVCacheCoordinator.decode_step``, ``decode_path.py``), which settles the
common cases and hands any other back, and a new request on one
full-attention group likewise to ``admit_step`` (``admit_path.py``,
D-PERF-17). The capacity check of every path is ``capacity.refuses``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from pagedkv.optimized.coordination.coordinator import TAKE_GENERAL_PATH, KVCacheCoordinator
from pagedkv.optimized.coordination.coordinator_kinds import make_coordinator
from pagedkv.optimized.paths.capacity import refuses
from pagedkv.optimized.paths.recovery import recover
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.optimized.pool.hasher import REQUEST_TYPE, make_block_hasher
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.manager_args import check_manager_args
from pagedkv.spec.request import Request, RequestFacts, RequestView, check_request_options
from pagedkv.spec.retention_config import RetentionConfig
from pagedkv.spec.stored_events import PER_CALL
from pagedkv.spec.types import PrefixCacheStats

from . import validation
from .manager_cache import ManagerCache
from .manager_reads import ManagerReads
from .native import NATIVE, LookupContext
from .retention_manager import RetentionOperations, make_pool, route_to_general_paths
from .sub_block_ops import SubBlockOperations

__all__ = ["KVCacheManager"]



class KVCacheManager(ManagerReads, ManagerCache, SubBlockOperations, RetentionOperations):
    """Allocates KV cache blocks to requests, with prefix caching.

    Args:
        kv_cache_config: blocks and groups: any number of groups of any
            supported spec type (spec/managers.md), with or without
            caching. With zero groups (attention-free models) nothing is
            hashed or hit.
        max_model_len: most tokens one request may hold (positive int).
        enable_caching: prefix caching on.
        hash_fn: ``"sha256"``, ``"sha256_cbor"``, ``"xxh3_128"`` (alias
            ``"xxhash"``).
        hash_block_size: tokens per request block hash; must divide every
            group's block size; default the GCD of the block sizes
            (D-HASH-5).
        use_eagle: a prefix hit gives back its last matched block.
        log_stats: keep :class:`PrefixCacheStats`.
        enable_kv_cache_events: collect events for :meth:`take_events`.
        dcp_world_size, pcp_world_size: context-parallel sizes; a group's
            block size is its spec block size times both.
        hash_seed: seed of the first block's parent hash.
        retention_interval: which sliding-window blocks are worth caching
            (``None``, ``0`` or a multiple of the hit alignment; spec/config.md).
        max_num_batched_tokens: the per-step token budget the windowed
            admission caps count with (default ``max_model_len``).
        num_hash_lookahead_tokens: each block hash also covers this many
            tokens after its block (spec/hashing.md section 7).
        num_prefill_lookahead: a multi-module drafter re-prefills the last
            ``num_prefill_lookahead - 1`` computed tokens; they are never
            cached (D-HASH-12).
        block_stored_events: ``"per_call"`` (default): one ``BlockStored``
            per caching call, as vLLM sends it; ``"per_run"``: one per
            contiguous run of newly cached blocks, each a valid chain segment
            (:mod:`pagedkv.spec.stored_events`, D-EVT-15).
        retention: ``None`` (default: the plain pool, nothing changes) or a
            :class:`~pagedkv.spec.retention_config.RetentionConfig`: the
            retention pool, the fast paths off (``retention_manager``).

    Raises:
        InvalidConfigError: max_model_len, world sizes, hash_block_size,
            retention_interval, max_num_batched_tokens or block_stored_events malformed, context
            parallelism with a group other than full attention, or a group
            the pool cannot hold (sink blocks).
        InvalidArgumentError: unknown hash_fn.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        hash_fn: str = "sha256",
        hash_block_size: int | None = None,
        use_eagle: bool = False,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        hash_seed: str | None = None,
        retention_interval: int | None = None,
        max_num_batched_tokens: int | None = None,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        block_stored_events: str = PER_CALL,
        retention: RetentionConfig | None = None,
    ) -> None:
        block_sizes, hbs = check_manager_args(
            kv_cache_config=kv_cache_config, max_model_len=max_model_len, hash_fn=hash_fn,
            hash_block_size=hash_block_size, dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size, retention_interval=retention_interval,
            max_num_batched_tokens=max_num_batched_tokens, hash_seed=hash_seed,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens, num_prefill_lookahead=num_prefill_lookahead)
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.num_prefill_lookahead = num_prefill_lookahead
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.use_eagle = bool(use_eagle)
        self.log_stats = bool(log_stats)
        self._kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(block_sizes)
        self.block_sizes: tuple[int, ...] = block_sizes
        self.hash_block_size = hbs
        self._pool = make_pool(retention, kv_cache_config.num_blocks, self.enable_caching,
                               enable_kv_cache_events=bool(enable_kv_cache_events),
                               num_groups=len(block_sizes), block_stored_events=block_stored_events)
        self._coordinator: KVCacheCoordinator = make_coordinator(
            kv_cache_config, block_pool=self._pool, block_sizes=block_sizes,
            hash_block_size=hbs if hbs is not None else 1, enable_caching=self.enable_caching,
            use_eagle=self.use_eagle, retention_interval=retention_interval,
            max_model_len=max_model_len, max_num_batched_tokens=self.max_num_batched_tokens)
        self._hasher = (None if hbs is None
                        else make_block_hasher(hash_fn, hbs, hash_seed, num_hash_lookahead_tokens))
        # Lookahead hashing: events carry the lookahead tokens; re-prefilled
        # tokens are never cached, which the decode fast path does not know
        # (D-HASH-12).
        self._pool.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self._coordinator.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        if self._coordinator.num_reprefillable_tokens:
            self._coordinator.decode_step = self._coordinator.admit_step = None
        self.prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if self.log_stats else None)
        self._empty = self._coordinator.empty_blocks
        # The one-group lookup's C scan, called from get_computed_blocks
        # itself: a call less per lookup (D-PERF-48). None: the coordinator's.
        self._scan = self._coordinator.one_group_scan()
        # The same lookup, its result built, and the release, in C (D-PERF-49): None
        # where they do not apply (another coordinator kind, the pure build).
        self._lookup: Callable[[RequestView], tuple[KVCacheBlocks, int] | None] | None = None
        if self._scan is not None and NATIVE is not None:
            _, table, block_size, pool = self._scan
            self._lookup = partial(NATIVE.lookup, LookupContext(
                table=table, block_size=block_size, pool=pool, blocks_type=KVCacheBlocks, hashes=pool.block_hashes))
        self._release = self._coordinator.native_release() or self._coordinator.release
        if retention is not None:
            self._release = route_to_general_paths(self._coordinator)

    # ------------------------------------------------------------ properties

    @property
    def block_pool(self) -> BlockPool:
        """The shared block pool. Cost: O(1)."""
        return self._pool

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The configuration this manager was built with. Cost: O(1)."""
        return self._kv_cache_config

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use. Cost: O(1)."""
        return self._pool.get_usage()

    @property
    def coordinator(self) -> KVCacheCoordinator:
        """The coordinator (for tests and tools). Cost: O(1)."""
        return self._coordinator

    # -------------------------------------------------------------- requests

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], **extra: Any) -> Request:
        """A :class:`pagedkv.spec.Request` hashed with this manager's hash
        function and hash block size (no hashing with zero groups).

        Cost: O(prompt tokens).

        Raises:
            InvalidArgumentError: as ``Request`` does (bad ids, tokens,
                multimodal ranges; xxh3_128 tokens >= 2**32), an option
                ``Request`` does not take, or the id of a request this
                manager holds (D-API-22).
        """
        check_request_options(extra)
        request = REQUEST_TYPE(request_id, prompt_token_ids, block_hasher=self._hasher, **extra)
        if request_id in self._coordinator.requests:
            raise InvalidArgumentError(
                f"request_id {request_id!r} belongs to a live request (allocated, not freed) (D-API-22)")
        return request

    def get_computed_blocks(self, request: RequestView) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request`` (at most
        ``num_tokens - 1`` tokens, whole blocks) and its token count.
        Records a lookup in the stats (log_stats) unless caching is off or
        the request skips reading the prefix cache. Touches no block.

        Cost: O(blocks hit + 1).

        Raises:
            InvalidArgumentError: ``request`` lacks a RequestView attribute.
        """
        try:
            skip = request.skip_reading_prefix_cache
        except AttributeError:
            raise InvalidArgumentError(f"request must have the attributes of RequestView, got {request!r}") from None
        if (not self.enable_caching or skip
                or not self.num_kv_cache_groups):
            return self._empty, 0  # LOOKUP-1
        lookup = self._lookup
        if lookup is not None and self.prefix_cache_stats is None:
            answer = lookup(request)
            if answer is not None:
                return answer
        scan = self._scan
        found = None
        if scan is not None:  # UnitaryCoordinator.find_longest_cache_hit's scan, memo included
            prefix_hits, table, block_size, pool = scan
            found = prefix_hits(table, request.block_hashes, (request.num_tokens - 1) // block_size, pool)
        if found is None:  # LOOKUP-2 (the cap), LOOKUP-3 and LOOKUP-4
            hit, num_hit_tokens = self._coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1)
        else:
            hit, num_hit_tokens = (found,), len(found) * block_size
        stats = self.prefix_cache_stats
        if stats is not None:  # LOOKUP-5
            stats.record(num_tokens=request.num_tokens, num_hits=num_hit_tokens,
                         preempted=request.num_preemptions > 0)
        return KVCacheBlocks(hit, self._pool.block_hashes), num_hit_tokens

    def get_computed_blocks_per_group(self, request: RequestView) -> tuple[KVCacheBlocks, tuple[int, ...]]:
        """Each group's own longest hit, not reconciled across groups (what a
        KV connector reads). Pure; no stats. Cost: one search per group."""
        coordinator = self._coordinator
        if (not self.enable_caching or request.skip_reading_prefix_cache
                or not self.num_kv_cache_groups):
            return self._empty, tuple(0 for _ in coordinator.managers)
        hits, lengths = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens - 1)
        return KVCacheBlocks(hits, self._pool.block_hashes), lengths

    def shared_prefix_boundary(self, request: RequestView, num_hit_tokens: int) -> int:
        """The leading group's own hit when it exceeds the common hit
        ``num_hit_tokens``, else 0 (the reference's docstring, D-SWA-11).
        Pure. Cost: 0 with one group, else one search of the leading group."""
        if (not self.enable_caching or self.num_kv_cache_groups < 2
                or request.skip_reading_prefix_cache):
            return 0
        extra = self._coordinator.uncached_shared_prefix(
            request.block_hashes, request.num_tokens - 1, num_hit_tokens)
        return num_hit_tokens + extra if extra else 0

    def allocate_slots(
        self,
        request: RequestView,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_in_flight_tokens: int = 0,
        watermark_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens (plus
        lookahead), taking a prefix hit (``new_computed_blocks``, covering
        ``num_new_computed_tokens``) if it is new, then cache the blocks its
        computed tokens fill (unless ``delay_cache_blocks``). Returns the
        newly allocated blocks, or ``None`` when the free queue is too short
        (no change beyond releasing blocks attention no longer reads,
        D-API-6). With ``full_sequence_must_fit`` the whole request must fit
        too, windowed groups counted at their admission cap (spec/managers.md
        §8). ``reserved_blocks`` more blocks must stay free beside the
        step's (D-API-13), ``watermark_blocks`` beside both (D-API-48);
        ``num_in_flight_tokens`` of the computed tokens are still being
        computed by an in-flight step, so skipped blocks are released on the
        settled basis (D-API-14); ``num_new_tokens`` may be 0 when computed
        tokens are adopted (D-API-12). The steps are spec/operations.md's,
        numbered alike.

        Cost: O(1) (one group) or O(groups) for a decode step that needs
        no new block, fills no block and releases none; otherwise O(groups
        + hit blocks + new blocks + blocks cached + blocks released).

        Raises (in the order of step 1):
            InvalidTokenCountError: ``num_new_tokens < 1`` (``< 0`` when
                adopting computed tokens) or a negative count.
            InvalidArgumentError: a wrong number of groups, a prefix hit for
                a known request or with caching off, a hit whose size
                disagrees with ``num_new_computed_tokens``, a stale hit (a
                block evicted or reused since ``get_computed_blocks``).
            UnknownBlockError: a hit names a block outside the pool.
            ExceedsMaxModelLenError: the request would exceed max_model_len.
        """
        decode_step = self._coordinator.decode_step
        # Identity with the cached int 0 (CPython keeps one): None, 0.0 or
        # False take the general path, which refuses them (a truth test let
        # them through). Compared with a local, not a module global: six
        # global loads cost the no-op decode step several percent.
        zero = 0
        if (decode_step is not None and new_computed_blocks is None
                and not full_sequence_must_fit and watermark_blocks is zero
                and num_new_computed_tokens is zero and num_lookahead_tokens is zero
                and num_external_computed_tokens is zero and num_encoder_tokens is zero
                and reserved_blocks is zero and num_in_flight_tokens is zero
                and type(num_new_tokens) is int and num_new_tokens >= 1):
            result = decode_step(request, num_new_tokens, delay_cache_blocks)
            if result is not TAKE_GENERAL_PATH:
                return result
        coordinator = self._coordinator
        # A new request on one full-attention group (admit_path, D-PERF-17):
        # settled there unless it hands the call back. It reads four of the
        # request's attributes, all before any change: with events off, a
        # request of a class this manager counts on (its own Request) goes in
        # without the snapshot (D-PERF-43), as pagedkv.vllm passes vLLM's (D-PERF-23).
        admit_step = coordinator.admit_step
        if (admit_step is not None and num_lookahead_tokens is zero and num_external_computed_tokens is zero
                and num_encoder_tokens is zero
                and (full_sequence_must_fit is False or full_sequence_must_fit is True)):
            raw = not self._pool.enable_kv_cache_events and request.__class__ in coordinator.well_formed_request_types
            if not raw:
                request = RequestFacts.capture(request)
            facts: Any = request
            result = admit_step(facts, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                delay_cache_blocks, reserved_blocks, watermark_blocks,
                                num_in_flight_tokens, full_sequence_must_fit)
            if result is not TAKE_GENERAL_PATH:
                return result
        # The engine's object is read once (here, or kept from above): no engine
        # code runs once something has changed (spec/operations.md, "Exception safety").
        request = RequestFacts.capture(request)
        request_id = request.request_id
        known = request_id in coordinator.requests
        # ALLOC-1: validate (all before any change).
        computed = validation.allocate_args(
            coordinator=coordinator, request=request, known_request=known,
            max_model_len=self.max_model_len, num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_new_computed_tokens,
            new_computed_blocks=new_computed_blocks, num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks, num_encoder_tokens=num_encoder_tokens,
            reserved_blocks=reserved_blocks, num_in_flight_tokens=num_in_flight_tokens,
            watermark_blocks=watermark_blocks)
        # ALLOC-2: token counts.
        local = request.num_computed_tokens + num_new_computed_tokens
        total = local + num_external_computed_tokens
        main = total + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        # ALLOC-3 to ALLOC-9 change state: an exception there (the engine's code is
        # not called any more) leaves a consistent manager (D-API-24).
        try:
            # ALLOC-3: remove skipped blocks, even if the allocation is then refused:
            # they are dead weight either way, and releasing them first spares
            # cached blocks from eviction (D-API-6).
            if known:  # on the settled basis: an in-flight step still reads its window (D-API-14)
                settled = total - num_in_flight_tokens
                coordinator.remove_skipped_blocks(request_id=request_id,
                                                  num_total_computed_tokens=settled if settled > 0 else 0,
                                                  num_prompt_tokens=request.num_prompt_tokens)
            # ALLOC-4, ALLOC-5: capacity (the Mamba step rule counts as a refusal here).
            demand = coordinator.get_num_blocks_to_allocate(
                request_id=request_id, num_tokens=need, new_computed_blocks=computed,
                num_total_computed_tokens=total, num_main_tokens=main,
                num_encoder_tokens=num_encoder_tokens,
                num_external_computed_tokens=num_external_computed_tokens)
            # Prefill checkpoints (spec/mamba.md): the chunk is [total, main).
            mamba_checkpoints = coordinator.mamba_managers
            if mamba_checkpoints:
                prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
                demand += coordinator.checkpoint_demand(request_id, total, main, prefill_end)
            # The step keeps reserved_blocks and the watermark free, the whole
            # request (full_sequence_must_fit) the watermark only (D-API-13, D-API-48).
            demand += reserved_blocks
            if full_sequence_must_fit:
                whole = min(request.num_tokens + num_lookahead_tokens, self.max_model_len)
                demand = max(demand, coordinator.full_sequence_demand(
                    request_id=request_id, num_tokens=whole, new_computed_blocks=computed,
                    num_encoder_tokens=num_encoder_tokens))
            if refuses(self._pool.get_num_free_blocks(), demand + watermark_blocks):
                return None
            # ALLOC-6: admit computed blocks (a new request only).
            if not known:
                coordinator.admit(request_id=request_id, new_computed_blocks=computed,
                                  num_local_computed_tokens=local,
                                  num_external_computed_tokens=num_external_computed_tokens)
            # ALLOC-7: allocate.
            if mamba_checkpoints:
                coordinator.reserve_checkpoints(request_id, total, main, prefill_end)
            new_blocks = coordinator.allocate_new_blocks(
                request_id=request_id, num_tokens=need, num_main_tokens=main,
                num_encoder_tokens=num_encoder_tokens)
            # ALLOC-8: cache.
            if self.enable_caching and not delay_cache_blocks:
                coordinator.cache_blocks(request=request, request_id=request_id,
                                         num_tokens=min(main, request.num_tokens))
            # ALLOC-9: return the blocks of ALLOC-7.
            if not any(new_blocks):
                return self._empty
            return KVCacheBlocks(new_blocks, self._pool.block_hashes)
        except BaseException:
            recover(coordinator)
            raise

    def free(self, request: RequestView, *, missing_ok: bool = False) -> None:
        """Release the request's blocks (group by group, tail first) and
        forget it. With ``missing_ok`` an unknown request is a no-op.

        Cost: O(blocks held).

        Raises:
            UnknownRequestError: unknown request and not ``missing_ok``.
        """
        coordinator = self._coordinator
        try:
            request_id = request.request_id
            held = request_id in coordinator.requests
        except (AttributeError, TypeError):
            # Not a request, or an unhashable id: typed errors, off the hot path.
            if not hasattr(request, "request_id"):
                raise InvalidArgumentError(
                    f"request must have the attributes of RequestView, got {request!r}") from None
            request_id = request.request_id
            held = False
        if not held:
            if missing_ok and isinstance(request_id, str):
                return
            validation.known(coordinator, request_id)  # FREE-1
        try:
            self._release(request_id)  # FREE-2..6: coordinator.release, or the same in C (D-PERF-49)
        except BaseException:
            recover(coordinator)
            raise

    # ----------------------------------------------------------- the cache
    # (the rest of the cache's upkeep is ManagerCache's)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash if no request holds blocks; marks the stats as
        reset on success (log_stats). Returns whether it succeeded.

        Cost: O(num_blocks) on success, O(1) on refusal.
        """
        try:
            reset = self._pool.reset_prefix_cache()
        except BaseException:
            recover(self._coordinator)
            raise
        if not reset:
            return False
        if self.prefix_cache_stats is not None:  # RESET-4
            self.prefix_cache_stats.reset = True
        return True

    # ------------------------------------------------------- introspection

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_blocks={self._pool.num_blocks}, "
                f"groups={self.num_kv_cache_groups}, caching={self.enable_caching}, "
                f"requests={len(self._coordinator.requests)})")

