"""The KV cache manager facade (spec/operations.md, "KVCacheManager").

What an engine's scheduler calls. Each public method validates everything
first and raises a typed error before touching state, so a refused call
leaves the manager exactly as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.reference import rules, validation
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.blocks import KVCacheBlocks
from pagedkv.reference.coordinator import KVCacheCoordinator, make_coordinator
from pagedkv.reference.features.enabled import FEATURES
from pagedkv.reference.hasher import make_block_hasher
from pagedkv.reference.mamba import MambaManager
from pagedkv.reference.recovery import recover
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hashing import normalize_hash_fn
from pagedkv.spec.manager_args import check_manager_args
from pagedkv.spec.request import Request, RequestFacts, RequestView, check_request_options
from pagedkv.spec.snapshot import ManagerSnapshot, RequestSnapshot
from pagedkv.spec.stored_events import PER_CALL
from pagedkv.spec.types import KVCacheEvent, PrefixCacheStats

__all__ = ["KVCacheManager"]


def _request_id(request: RequestView) -> str:
    """``request.request_id``, or a typed error for an object without one."""
    try:
        return request.request_id
    except AttributeError:
        raise InvalidArgumentError(f"request must have the attributes of RequestView, got {request!r}") from None


class KVCacheManager:
    """Allocates, caches and frees the KV cache blocks of requests.

    ``kv_cache_config`` gives the pool size and the groups; ``max_model_len``
    bounds every request. ``hash_fn`` names the block hash
    (spec/hashing.md); ``hash_block_size`` must divide every group's block
    size (``None`` picks their GCD). The other arguments are those of
    spec/operations.md, "KVCacheManager" (the optimized manager's docstring
    describes each). The facade builds the pool; the coordinator builds the
    per-group managers over it and holds the state;
    ``pagedkv.spec.manager_args`` checks the constructor's arguments and
    ``validation`` those of every other call.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, *,
                 enable_caching: bool = True, hash_fn: str = "sha256",
                 hash_block_size: int | None = None, use_eagle: bool = False,
                 log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1,
                 hash_seed: str | None = None, retention_interval: int | None = None,
                 max_num_batched_tokens: int | None = None, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0, block_stored_events: str = PER_CALL) -> None:
        self.block_sizes, hash_block_size = check_manager_args(
            kv_cache_config=kv_cache_config, max_model_len=max_model_len, hash_fn=hash_fn,
            hash_block_size=hash_block_size, dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size, retention_interval=retention_interval,
            max_num_batched_tokens=max_num_batched_tokens, hash_seed=hash_seed,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens, num_prefill_lookahead=num_prefill_lookahead)
        self.kv_cache_config = kv_cache_config
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.num_prefill_lookahead = num_prefill_lookahead
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.hash_fn = normalize_hash_fn(hash_fn)
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len
        self.hash_block_size = hash_block_size
        self.hash_seed = hash_seed
        self._pool = BlockPool(kv_cache_config.num_blocks, enable_caching,
                               enable_kv_cache_events=enable_kv_cache_events,
                               num_groups=len(self.block_sizes),
                               block_stored_events=block_stored_events)
        self.coordinator: KVCacheCoordinator = make_coordinator(
            kv_cache_config, block_pool=self._pool, block_sizes=self.block_sizes,
            hash_block_size=hash_block_size or 1, enable_caching=enable_caching,
            use_eagle=use_eagle, retention_interval=retention_interval,
            max_model_len=max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
            features=FEATURES)
        # Lookahead hashing (spec/hashing.md section 7): events carry the
        # lookahead tokens; a multi-module drafter's re-prefilled tokens are
        # never cached (D-HASH-12).
        self._pool.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.coordinator.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None

    # -- requests -------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], **extra: Any) -> Request:
        """A :class:`Request` whose block hashes follow this manager's hashing.

        Raises:
            InvalidArgumentError: as ``Request`` does, an option ``Request``
                does not take, or the id of a request this manager holds
                (one live request per id, D-API-22).
        """
        check_request_options(extra)
        hasher = None if self.hash_block_size is None else make_block_hasher(
            self.hash_fn, self.hash_block_size, self.hash_seed, self.num_hash_lookahead_tokens)
        request = Request(request_id, prompt_token_ids, block_hasher=hasher, **extra)
        if request_id in self.coordinator.known:
            raise InvalidArgumentError(
                f"request_id {request_id!r} belongs to a live request (allocated, not freed) (D-API-22)")
        return request

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
        request = RequestFacts.capture(request)
        empty = KVCacheBlocks([[] for _ in self.coordinator.managers])
        if not self.enable_caching or request.skip_reading_prefix_cache or not self.coordinator.managers:
            return empty, 0  # LOOKUP-1
        # LOOKUP-2: the last token is always recomputed.
        max_length = rules.max_hit_tokens(validation.count("request.num_tokens", request.num_tokens, 1))
        # LOOKUP-3, LOOKUP-4: the longest common hit and each group's blocks.
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)
        if self.prefix_cache_stats is not None:  # LOOKUP-5
            self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hit_tokens,
                                           preempted=request.num_preemptions > 0)
        return KVCacheBlocks(hits), num_hit_tokens  # LOOKUP-6: nothing else changed

    def get_computed_blocks_per_group(self, request: RequestView) -> tuple[KVCacheBlocks, tuple[int, ...]]:
        """Each group's own longest hit (at most ``num_tokens - 1`` tokens),
        not reconciled across groups: what a KV connector reads. Pure; no stats."""
        request = RequestFacts.capture(request)
        if not self.enable_caching or request.skip_reading_prefix_cache or not self.coordinator.managers:
            return KVCacheBlocks([[] for _ in self.coordinator.managers]), tuple(
                0 for _ in self.coordinator.managers)
        max_length = rules.max_hit_tokens(validation.count("request.num_tokens", request.num_tokens, 1))
        hits, lengths = self.coordinator.find_longest_cache_hit_per_group(request.block_hashes, max_length)
        return KVCacheBlocks(hits), lengths

    def shared_prefix_boundary(self, request: RequestView, num_hit_tokens: int) -> int:
        """The junction of a prefix ``request`` shares with an earlier request
        that the leading group caches but a sparser group does not (yet):
        the leading group's own hit when it exceeds the common hit
        ``num_hit_tokens`` (from ``get_computed_blocks``), else 0. The engine
        may pin it as ``request.shared_prefix_boundary`` so that sparse
        retention keeps the window tail there (D-SWA-11). Pure."""
        request = RequestFacts.capture(request)
        if not self.enable_caching or request.skip_reading_prefix_cache or not self.coordinator.managers:
            return 0
        max_length = rules.max_hit_tokens(validation.count("request.num_tokens", request.num_tokens, 1))
        extra = self.coordinator.uncached_shared_prefix(request.block_hashes, max_length, num_hit_tokens)
        return num_hit_tokens + extra if extra else 0

    def allocate_slots(self, request: RequestView, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       num_in_flight_tokens: int = 0, watermark_blocks: int = 0) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens (plus
        lookahead), taking the hit blocks of ``get_computed_blocks``.

        Returns the newly allocated blocks, or ``None`` (and no change beyond
        releasing blocks attention no longer reads, D-API-6) when the pool
        cannot supply them. With ``full_sequence_must_fit`` the whole request
        (all its tokens, windowed groups at their admission cap) must fit too,
        so an engine admitting by that rule and startup sizing agree
        (spec/managers.md §8). ``reserved_blocks`` more blocks must stay free
        beside the step's blocks (D-API-13), ``watermark_blocks`` more beside
        both the step's and the whole request's (D-API-48); skipped blocks
        are released on the settled basis, the computed tokens less
        ``num_in_flight_tokens`` (D-API-14); a call that adopts computed
        tokens may bring no new token (D-API-12).

        Raises:
            InvalidTokenCountError, InvalidArgumentError, UnknownBlockError,
            ExceedsMaxModelLenError.
        """
        # The engine's object is read once, here: no engine code runs once
        # something has changed (spec/operations.md, "Exception safety").
        request = RequestFacts.capture(request)
        request_id = request.request_id
        coordinator = self.coordinator
        known = request_id in coordinator.known
        # ALLOC-1: validate (all before any change).
        hits = validation.allocate_args(
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
        need = min(main + num_lookahead_tokens, self.max_model_len)  # lookahead capped (D-API-3)
        try:
            return self._commit_allocation(
                request, known, hits, local=local, total=total, main=main, need=need,
                num_lookahead_tokens=num_lookahead_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                delay_cache_blocks=delay_cache_blocks, num_encoder_tokens=num_encoder_tokens,
                full_sequence_must_fit=full_sequence_must_fit, reserved_blocks=reserved_blocks,
                num_in_flight_tokens=num_in_flight_tokens, watermark_blocks=watermark_blocks)
        except BaseException:
            recover(coordinator)
            raise

    def _commit_allocation(self, request: RequestFacts, known: bool,
                           hits: tuple[tuple[KVCacheBlock, ...], ...], *, local: int, total: int,
                           main: int, need: int, num_lookahead_tokens: int,
                           num_external_computed_tokens: int, delay_cache_blocks: bool,
                           num_encoder_tokens: int, full_sequence_must_fit: bool, reserved_blocks: int,
                           num_in_flight_tokens: int, watermark_blocks: int) -> KVCacheBlocks | None:
        """Steps 3 to 9 of ``allocate_slots``, on validated arguments."""
        request_id = request.request_id
        coordinator = self.coordinator
        # ALLOC-3: remove skipped blocks: released even if the allocation is then
        # refused; they are dead weight either way, and releasing them first
        # spares cached blocks from eviction (D-API-6). A no-op for a new request.
        # On the settled basis: an in-flight step still reads its window (D-API-14).
        coordinator.remove_skipped_blocks(request_id=request_id,
                                          num_total_computed_tokens=max(0, total - num_in_flight_tokens),
                                          num_prompt_tokens=request.num_prompt_tokens)
        # ALLOC-4, ALLOC-5: capacity (the Mamba step rule counts as a refusal here).
        demand = coordinator.get_num_blocks_to_allocate(
            request_id=request_id, num_tokens=need, new_computed_blocks=hits,
            num_total_computed_tokens=total, num_main_tokens=main,
            num_encoder_tokens=num_encoder_tokens,
            num_external_computed_tokens=num_external_computed_tokens)
        # Prefill checkpoints (spec/mamba.md): the chunk is [total, main).
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        demand += coordinator.checkpoint_demand(request_id, total, main, prefill_end)
        # Two gates on the free blocks (D-API-13, D-API-48): the step's demand
        # keeps reserved_blocks and the watermark free, the whole request's
        # (with full_sequence_must_fit) the watermark only.
        free = self._pool.get_num_free_blocks()
        if demand + reserved_blocks + watermark_blocks > free:
            return None
        if full_sequence_must_fit:
            whole = min(request.num_tokens + num_lookahead_tokens, self.max_model_len)
            if coordinator.full_sequence_demand(
                    request_id=request_id, num_tokens=whole, new_computed_blocks=hits,
                    num_encoder_tokens=num_encoder_tokens) + watermark_blocks > free:
                return None
        # ALLOC-6: admit computed blocks (a new request only).
        if not known:
            coordinator.admit(request_id=request_id, new_computed_blocks=hits,
                              num_local_computed_tokens=local,
                              num_external_computed_tokens=num_external_computed_tokens)
        # ALLOC-7: allocate.
        coordinator.reserve_checkpoints(request_id, total, main, prefill_end)
        new_blocks = coordinator.allocate_new_blocks(
            request_id=request_id, num_tokens=need, num_main_tokens=main,
            num_encoder_tokens=num_encoder_tokens)
        # ALLOC-8: cache (lookahead tokens never are).
        if self.enable_caching and not delay_cache_blocks:
            coordinator.cache_blocks(request=request, request_id=request_id,
                                     num_tokens=min(main, request.num_tokens))
        # ALLOC-9: return the blocks of ALLOC-7.
        return KVCacheBlocks(new_blocks)

    def free(self, request: RequestView, *, missing_ok: bool = False) -> None:
        """Release every block of the request, tail first.

        Raises:
            UnknownRequestError: the request holds no allocation (unless
                ``missing_ok``, for engines aborting unadmitted requests).
        """
        request_id = _request_id(request)
        if missing_ok:
            try:
                if request_id not in self.coordinator.known:
                    return
            except TypeError:
                pass  # validation.known names the bad id
        validation.known(self.coordinator, request_id)  # FREE-1
        try:
            self.coordinator.release(request_id)  # FREE-2..6
        except BaseException:
            recover(self.coordinator)
            raise

    def cache_blocks(self, request: RequestView, num_computed_tokens: int) -> None:
        """Hand the full blocks among the first ``num_computed_tokens`` tokens
        to the prefix cache (no-op with caching off)."""
        if not self.enable_caching:
            return
        request = RequestFacts.capture(request)
        validation.cache_blocks_args(coordinator=self.coordinator, request=request,
                                     num_computed_tokens=num_computed_tokens)
        try:
            self.coordinator.cache_blocks(request=request, request_id=request.request_id,
                                          num_tokens=num_computed_tokens)
        except BaseException:
            recover(self.coordinator)
            raise

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache keys of the given blocks (spec: evict_blocks).

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
            recover(self.coordinator)
            raise

    def reset_prefix_cache(self) -> bool:
        """Drop every cache key if no block is in use; ``False`` otherwise."""
        try:
            reset = self._pool.reset_prefix_cache()
        except BaseException:
            recover(self.coordinator)
            raise
        if not reset:
            return False
        if self.prefix_cache_stats is not None:  # RESET-4
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, the leading blocks of ``request_id`` every known request holds."""
        validation.known(self.coordinator, request_id)
        return self.coordinator.get_num_common_prefix_blocks(request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group."""
        validation.known(self.coordinator, request_id)
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

    def enable_partial_hash_hits(self, dcp_world_size: int = 1, *, shared_prefix_checkpoint: bool = False) -> None:
        """Turn on sub-block hits with copy-on-write (spec/mamba.md, MPART-1..6,
        FPART-1..5); ``dcp_world_size``: the decode context parallelism the
        group block sizes already reflect (D-MAMBA-20); ``shared_prefix_checkpoint``:
        Mamba groups also publish the state at a request's observed junction,
        where an EAGLE sibling resumes (MPART-6, D-MAMBA-40).

        Raises:
            InvalidConfigError: unsupported configuration (D-MAMBA-15, D-MAMBA-21, D-MAMBA-40),
                requests already known, or a malformed ``dcp_world_size``.
        """
        self.coordinator.enable_partial_hash_hits(dcp_world_size, shared_prefix_checkpoint=shared_prefix_checkpoint)

    def take_kv_cache_block_copies(self, *, hand_over: bool = False) -> tuple[list[tuple[int, int]], list[int]]:
        """Copy-on-write copies queued since the last call, as ``(source id,
        destination id)``, and the retained block ids (each pair's source then
        destination): the caller runs the copies, then hands the retained ids
        to :meth:`release_copy_retentions` (MPART-3). With ``hand_over`` the
        retentions become plain references the caller frees through the pool
        (an engine's own deferred free, D-MAMBA-19)."""
        pairs = self.coordinator.take_block_copies(hand_over=hand_over)
        return ([(source.block_id, destination.block_id) for source, destination in pairs],
                [block.block_id for pair in pairs for block in pair])

    def release_copy_retentions(self, block_ids: Sequence[int]) -> None:
        """Drop the retention reference of each block id, in order (after the copies ran).

        Raises:
            InvalidArgumentError: an id not retained by a taken copy (no change).
        """
        self.coordinator.release_copy_retentions(block_ids)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba ``align`` boundary states cached since the last call, for a KV
        connector to offload: request id -> ``(group id, block id, tokens)``
        by group, then oldest first (spec/mamba.md, MOFF-1)."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for group in self.coordinator.managers:
            if isinstance(group, MambaManager):
                for request_id, block, num_tokens in group.take_offers():
                    offloads.setdefault(request_id, []).append((group.group_id, block.block_id, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request_id: str, num_computed_tokens: int,
                                       num_in_flight_tokens: int) -> list[tuple[int, int, int]]:
        """A finishing request's Mamba ``align`` prompt tails that no copy
        preserved, for a KV connector to offload from the block itself:
        ``(group id, block id, boundary)`` per group, in group order. Given only
        when ``num_in_flight_tokens == 0`` and ``num_computed_tokens`` is the
        boundary (no later token overwrote the state); the record is consumed
        either way, so a second call gives nothing (spec/mamba.md, MTAIL-1).

        Raises:
            InvalidArgumentError: a count is not an int >= 0 (no change).
        """
        if not all(type(count) is int and count >= 0 for count in (num_computed_tokens, num_in_flight_tokens)):
            raise InvalidArgumentError(
                f"num_computed_tokens and num_in_flight_tokens must be ints >= 0, got "
                f"{num_computed_tokens!r} and {num_in_flight_tokens!r}")
        offloads: list[tuple[int, int, int]] = []
        for group in self.coordinator.managers:
            if isinstance(group, MambaManager):
                tail = group.finalize_partial_tail(request_id, num_computed_tokens, num_in_flight_tokens)
                if tail is not None:
                    offloads.append((group.group_id, tail[0].block_id, tail[1]))
        return offloads

    def new_step_starts(self) -> None:
        """A scheduler step begins: Mamba groups may serve states cached in
        the previous step from now on (MAMBA-2)."""
        try:
            self.coordinator.new_step_starts()
        except BaseException:
            recover(self.coordinator)
            raise

    # -- observation ------------------------------------------------------------

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
