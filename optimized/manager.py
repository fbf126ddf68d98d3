"""KVCacheManager: the facade an engine's scheduler calls.

Semantic model (notes/semantics.md, "KVCacheManager operations"): a block
pool shared by the KV cache groups, and for each *known* request (holding
an allocation, from its first successful ``allocate_slots`` until
``free``) a block list per group plus a count of cached blocks. Requests
are read, never owned: any object with the attributes of
:class:`pagedkv.spec.RequestView` works.

Every public method validates first and raises a typed error from
``pagedkv.spec.errors`` before changing anything. Validation lives in
``_validation.py``; the work is delegated to a coordinator
(``coordinator.py``). ``allocate_slots`` has a fast path for the common
decode step: a known request whose new tokens fit in the blocks it holds,
that fills no new block and (several groups, ``decode.py``) moves no window
past a block boundary: O(1) with one group, O(groups) with several. With
one full-attention group, the other steps of a known request (a block fills
or is needed) skip the validation and dispatch (``decode.allocate_known_single``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import (
    InvalidConfigError,
)
from pagedkv.spec.request import Request, RequestView
from pagedkv.spec.snapshot import ManagerSnapshot, RequestSnapshot
from pagedkv.spec.types import KVCacheEvent, PrefixCacheStats

from . import _validation as check
from .admission import admission_caps, full_sequence_demand
from .block_pool import BlockPool
from .blocks import KVCacheBlocks
from .coordinator import KVCacheCoordinator, make_coordinator
from .decode import allocate_known_single, decode_probes, is_noop_decode
from .hasher import make_block_hasher
from .pool_invariants import check_request_invariants
from .single_type import FullAttentionManager

__all__ = ["KVCacheManager"]


class KVCacheManager:
    """Allocates KV cache blocks to requests, with prefix caching.

    Args:
        kv_cache_config: blocks and groups. With caching, at most one
            group; without, any number. With zero groups (attention-free
            models) nothing is hashed or hit.
            Every group's spec must be a ``FullAttentionSpec`` for now.
        max_model_len: most tokens one request may hold (positive int).
        enable_caching: prefix caching on.
        hash_fn: ``"sha256"``, ``"sha256_cbor"``, ``"xxh3_128"`` (alias
            ``"xxhash"``).
        hash_block_size: tokens per request block hash; default (and, with
            caching, the only accepted value) the block size of group 0.
        use_eagle: a prefix hit gives back its last matched block.
        log_stats: keep :class:`PrefixCacheStats`.
        enable_kv_cache_events: collect events for :meth:`take_events`.
        dcp_world_size, pcp_world_size: context-parallel sizes; a group's
            block size is its spec block size times both.
        hash_seed: seed of the first block's parent hash.

    Raises:
        InvalidConfigError: max_model_len, world sizes or hash_block_size
            malformed, or an unsupported configuration (spec type, more
            than one group with caching, hash block size differing from
            the block size with caching).
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
    ) -> None:
        block_sizes, hbs = check.constructor_args(
            kv_cache_config, max_model_len, enable_caching, hash_fn, hash_block_size,
            dcp_world_size, pcp_world_size, retention_interval)
        if max_num_batched_tokens is not None and (type(max_num_batched_tokens) is not int
                                                   or max_num_batched_tokens < 1):
            raise InvalidConfigError(
                f"max_num_batched_tokens must be a positive int or None, got {max_num_batched_tokens!r}")
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.use_eagle = bool(use_eagle)
        self.log_stats = bool(log_stats)
        self._kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(block_sizes)
        self.block_sizes: tuple[int, ...] = block_sizes
        self.hash_block_size = hbs
        self._coordinator: KVCacheCoordinator = make_coordinator(
            kv_cache_config, self.use_eagle, self.enable_caching,
            bool(enable_kv_cache_events), block_sizes, hbs if hbs is not None else 1,
            retention_interval)
        self._pool: BlockPool = self._coordinator.block_pool
        # The per-request caps startup sizing counts (spec CFG-7, CFG-8).
        self._admission_caps = admission_caps(
            self._coordinator.managers, self.max_num_batched_tokens, max_model_len)
        self._hasher = (None if hbs is None else make_block_hasher(hash_fn, hbs, hash_seed))
        self.prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if self.log_stats else None)
        # Shared empty result: never mutated (KVCacheBlocks lists are not).
        self._empty = KVCacheBlocks(tuple([] for _ in block_sizes), self._pool.block_hashes)
        # Fast-path bindings for the single-group case (the common one).
        self._single_blocks: dict[str, list[int]] | None = None
        self._single_cached: dict[str, int] = {}
        self._block_size0 = block_sizes[0] if block_sizes else 1
        # The decode fast path skips remove_skipped_blocks and the per-group
        # hash views: only for one full-attention group hashed at its size.
        if len(block_sizes) == 1 and hbs == block_sizes[0] and isinstance(
                self._coordinator.managers[0], FullAttentionManager):
            manager = self._coordinator.managers[0]
            self._single_blocks = manager.req_to_blocks
            self._single_cached = manager.cached_count
        # The decode fast path of every other configuration (``decode.py``);
        # None where a group's type is not covered.
        self._decode_probes = (
            decode_probes(self._coordinator.managers)
            if self._single_blocks is None and block_sizes else None)

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
                multimodal ranges; xxh3_128 tokens >= 2**32).
        """
        return Request(request_id, prompt_token_ids, block_hasher=self._hasher, **extra)

    def get_computed_blocks(self, request: RequestView) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request`` (at most
        ``num_tokens - 1`` tokens, whole blocks) and its token count.
        Records a lookup in the stats (log_stats) unless caching is off or
        the request skips reading the prefix cache. Touches no block.

        Cost: O(blocks hit + 1).
        """
        if (not self.enable_caching or request.skip_reading_prefix_cache
                or not self.num_kv_cache_groups):
            return self._empty, 0
        hit, num_hit_tokens = self._coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)
        stats = self.prefix_cache_stats
        if stats is not None:
            stats.record(num_tokens=request.num_tokens, num_hits=num_hit_tokens,
                         preempted=request.num_preemptions > 0)
        return KVCacheBlocks(hit, self._pool.block_hashes), num_hit_tokens

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
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens (plus
        lookahead), taking a prefix hit (``new_computed_blocks``, covering
        ``num_new_computed_tokens``) if it is new, then cache the blocks its
        computed tokens fill (unless ``delay_cache_blocks``). Returns the
        newly allocated blocks, or ``None`` when the free queue is too short
        (no change beyond releasing blocks attention no longer reads,
        D-API-6). With ``full_sequence_must_fit`` the whole request must fit
        too, windowed groups counted at their admission cap (spec/managers.md
        §8).

        Cost: O(1) (one group) or O(groups) for a decode step that needs
        no new block, fills no block and releases none; otherwise O(groups
        + hit blocks + new blocks + blocks cached + blocks released).

        Raises:
            InvalidTokenCountError: ``num_new_tokens < 1`` or a negative count.
            InvalidArgumentError: a prefix hit for a known request or with
                caching off, a hit whose size disagrees with
                ``num_new_computed_tokens``, a stale hit (a block evicted or
                reused since ``get_computed_blocks``), a wrong number of
                groups.
            UnknownBlockError: a hit names a block outside the pool.
            ExceedsMaxModelLenError: the request would exceed max_model_len.
        """
        if (new_computed_blocks is None and not full_sequence_must_fit
                and not (num_new_computed_tokens or num_lookahead_tokens
                         or num_external_computed_tokens or num_encoder_tokens)
                and type(num_new_tokens) is int and num_new_tokens >= 1):
            single_blocks = self._single_blocks
            if single_blocks is not None:
                # Decode fast path: nothing new to take, touch or validate
                # beyond the bounds checked here; no object is created.
                request_id = request.request_id
                blocks = single_blocks.get(request_id)
                num_computed = request.num_computed_tokens
                if blocks is not None and type(num_computed) is int:
                    total = num_computed + num_new_tokens
                    block_size = self._block_size0
                    # total >= num_new_tokens: a negative num_computed_tokens
                    # (or a non-int one, above) takes the slow path, which raises.
                    if num_new_tokens <= total <= len(blocks) * block_size and (
                            total <= self.max_model_len):
                        if not self.enable_caching or delay_cache_blocks:
                            return self._empty
                        # The blocks filled are min(total, num_tokens) // b:
                        # none is new when total alone fills none, so
                        # num_tokens (a property call) is left to the helper.
                        if total // block_size <= self._single_cached[request_id]:
                            return self._empty
                    # A block to fill or to add: the general path's work
                    # without its validation and dispatch (decode.py).
                    return allocate_known_single(
                        self, request, blocks, num_new_tokens, delay_cache_blocks)
            elif self._decode_probes is not None:
                # Other configurations: the same step, decided per group in
                # decode.is_noop_decode (windows that move past a block
                # boundary and filled blocks take the general path).
                num_computed = request.num_computed_tokens
                total = num_computed + num_new_tokens
                if type(num_computed) is int and num_new_tokens <= total <= self.max_model_len:
                    cache_tokens = -1  # the step caches nothing
                    if self.enable_caching and not delay_cache_blocks:
                        num_tokens = request.num_tokens
                        cache_tokens = total if total < num_tokens else num_tokens
                    # Hashes falling short of the blocks to cache: the
                    # general path raises.
                    if cache_tokens // (self.hash_block_size or 1) <= len(request.block_hashes) and (
                            is_noop_decode(self._decode_probes, request.request_id, num_computed,
                                           total, cache_tokens)):
                        return self._empty
        return self._allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens, full_sequence_must_fit)

    def _allocate_slots(
        self, request: RequestView, num_new_tokens: int, num_new_computed_tokens: int,
        new_computed_blocks: Any, num_lookahead_tokens: int,
        num_external_computed_tokens: int, delay_cache_blocks: bool, num_encoder_tokens: int,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        """The general allocation path (see :meth:`allocate_slots`)."""
        coordinator = self._coordinator
        request_id = request.request_id
        known = request_id in coordinator.requests
        computed = check.allocate_args(
            self, request, known, num_new_tokens, num_new_computed_tokens,
            new_computed_blocks, num_lookahead_tokens, num_external_computed_tokens,
            delay_cache_blocks, num_encoder_tokens)
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total_computed = num_local_computed + num_external_computed_tokens
        num_tokens_main = num_total_computed + num_new_tokens
        num_tokens_need = min(num_tokens_main + num_lookahead_tokens, self.max_model_len)
        # Blocks attention no longer reads are released even if the
        # allocation is then refused: they are dead weight either way, and
        # releasing them first spares cached blocks from eviction (D-API-6).
        if known:
            coordinator.remove_skipped_blocks(request_id, num_total_computed)
        num_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need, computed, num_total_computed, num_tokens_main,
            num_encoder_tokens, num_external_computed_tokens)
        if full_sequence_must_fit:
            whole = min(request.num_tokens + num_lookahead_tokens, self.max_model_len)
            num_to_allocate = max(num_to_allocate, full_sequence_demand(
                coordinator.managers, self._admission_caps, request_id, whole, computed,
                num_encoder_tokens, self._pool.ref_counts))
        if num_to_allocate > self._pool.get_num_free_blocks():
            return None
        if not known:
            coordinator.admit(
                request_id, computed, num_local_computed, num_external_computed_tokens)
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need, num_tokens_main, num_encoder_tokens)
        if self.enable_caching and not delay_cache_blocks:
            coordinator.cache_blocks(
                request, request_id, min(num_tokens_main, request.num_tokens))
        if not any(new_blocks):
            return self._empty
        return KVCacheBlocks(new_blocks, self._pool.block_hashes)

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
        request_id = request.request_id
        check.known(self._coordinator, request_id)
        self._coordinator.check_cache_blocks(request, request_id, num_computed_tokens)
        self._coordinator.cache_blocks(request, request_id, num_computed_tokens)

    def free(self, request: RequestView, *, missing_ok: bool = False) -> None:
        """Release the request's blocks (group by group, tail first) and
        forget it. With ``missing_ok`` an unknown request is a no-op.

        Cost: O(blocks held).

        Raises:
            UnknownRequestError: unknown request and not ``missing_ok``.
        """
        request_id = request.request_id
        coordinator = self._coordinator
        requests = coordinator.requests
        if request_id not in requests:
            if missing_ok:
                return
            check.known(coordinator, request_id)
        single_blocks = self._single_blocks
        if single_blocks is not None:
            # One full-attention group: coordinator.release and
            # FullAttentionManager.release inlined (two calls fewer on a
            # per-request path); the differential tests hold them equal.
            requests.remove(request_id)
            blocks = single_blocks.pop(request_id)
            del self._single_cached[request_id]
            blocks.reverse()  # tail first; the list is dropped
            self._pool._free(blocks)
            return
        coordinator.release(request_id)

    # ----------------------------------------------------------- the cache

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of the given blocks (see ``BlockPool.evict_blocks``).

        Cost: O(len(block_ids)).

        Raises:
            UnknownBlockError: an id outside ``[0, num_blocks)`` (no change).
        """
        self._pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash if no request holds blocks; marks the stats as
        reset on success (log_stats). Returns whether it succeeded.

        Cost: O(num_blocks) on success, O(1) on refusal.
        """
        if not self._pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, the leading blocks of the request that every known
        request holds.

        Cost: O(groups + common blocks).

        Raises:
            UnknownRequestError: the request holds no allocation.
        """
        check.known(self._coordinator, request_id)
        return self._coordinator.get_num_common_prefix_blocks(request_id)

    def take_events(self) -> list[KVCacheEvent]:
        """Pending events, oldest first; empties the queue. Cost: O(1)."""
        return self._pool.take_events()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (a copy).

        Cost: O(blocks held).

        Raises:
            UnknownRequestError: the request holds no allocation.
        """
        check.known(self._coordinator, request_id)
        return KVCacheBlocks(
            tuple([list(group) for group in self._coordinator.get_blocks(request_id)]),
            self._pool.block_hashes)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (fresh lists).

        Cost: O(blocks held).

        Raises:
            UnknownRequestError: the request holds no allocation.
        """
        check.known(self._coordinator, request_id)
        return tuple([list(group) for group in self._coordinator.get_blocks(request_id)])

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

    # ------------------------------------------------------- introspection

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
        """Check the pool invariants and REQ-1..5. Cost: O(num_blocks + blocks held).

        Raises:
            InvariantViolation: the message starts with the invariant's ID.
        """
        self._pool.check_invariants()
        check_request_invariants(self._pool, self._coordinator, self.snapshot)

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_blocks={self._pool.num_blocks}, "
                f"groups={self.num_kv_cache_groups}, caching={self.enable_caching}, "
                f"requests={len(self._coordinator.requests)})")

