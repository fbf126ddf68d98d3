"""``pagedkv.vllm.KVCacheManager``: vLLM 0.33's KV cache manager API over pagedkv.

A translation layer: it takes vLLM's ``KVCacheConfig`` and ``Request``
objects, calls :class:`pagedkv.optimized.KVCacheManager`, and answers with
vLLM's ``KVCacheBlocks`` holding vLLM-style block objects (live views of
pagedkv's pool, :mod:`pagedkv.vllm.blocks`), vLLM's events and stats.
Every block decision -- what a prefix hit is, which blocks are taken,
cached, evicted, freed and in which order -- is pagedkv's.

Where vLLM 0.33's scheduler needs an operation pagedkv's facade does not
offer as such, this layer composes it from pagedkv operations and says so
at the method (``pop_blocks_for_free`` = pin + free, D-VLLM-3); vLLM's
``reserved_blocks`` and watermark pass as pagedkv's ``reserved_blocks`` and
``watermark_blocks`` (D-API-13, D-API-48). docs/vllm.md lists what differs
from vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.optimized.engine import TAKE_GENERAL_PATH, FullAttentionManager, UnitaryCoordinator, recover
from pagedkv.optimized.engine import KVCacheBlocks as CoreBlocks
from pagedkv.optimized.engine import KVCacheManager as CoreManager
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.retention_config import RetentionConfig

from . import _compat
from .blocks import BlockPoolView, BlockView, hit_block_ids
from .config import translate_config
from .coordinator import make_coordinator_view
from .hisparse_manager import HiSparseKVCacheManager
from .lookups import Lookups
from .mamba import enable_partial_hits_where_vllm_would
from .requests import VllmRequestView, capture_request
from .retention_wiring import RequestRetention, RetentionSetup
from .step_drains import StepDrains
from .zeroing import ZeroingRecorder

__all__ = ["KVCacheManager"]

_VLLM_REQUEST: Any = _compat.VllmRequest


class KVCacheManager(Lookups, StepDrains):
    """vLLM 0.33's ``KVCacheManager`` (same constructor and methods) on pagedkv.

    Lookahead hashing (``num_hash_lookahead_tokens``) and a multi-module
    drafter's re-prefilled tokens (``num_prefill_lookahead``) are pagedkv's
    own (spec/hashing.md section 7, D-HASH-10..12). ``retention`` (pagedkv's,
    default ``None``: nothing changes) builds the core with its retention pool
    and applies each request's directives (:mod:`pagedkv.vllm.retention_wiring`).
    """

    def __new__(cls, kv_cache_config: Any, *args: Any, **kwargs: Any) -> KVCacheManager:
        if cls is KVCacheManager and getattr(kv_cache_config, "hisparse_host_num_blocks",
                                             None) is not None:
            # A HiSparse config: the device groups' manager composed with the host tier.
            if kwargs.pop("retention", None) is not None:
                raise InvalidConfigError("retention: not supported with a HiSparse host tier")
            return HiSparseKVCacheManager(kv_cache_config, *args, **kwargs)  # type: ignore[return-value]
        return super().__new__(cls)

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        retention: RetentionSetup | RetentionConfig | None = None,
    ) -> None:
        self.num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)
        self.num_prefill_lookahead = int(num_prefill_lookahead)
        if (enable_caching and scheduler_block_size < self.num_prefill_lookahead
                and (use_eagle or any(getattr(group, "is_eagle_group", False)
                                      for group in kv_cache_config.kv_cache_groups))):
            # vLLM 0.33's own refusal: the EAGLE drop must cover every re-prefilled token (D-HASH-12).
            raise InvalidConfigError(
                f"num_prefill_lookahead ({self.num_prefill_lookahead}) exceeds scheduler_block_size "
                f"({scheduler_block_size}): prefix caching with EAGLE groups needs "
                "scheduler_block_size >= num_prefill_lookahead")
        if not watermark >= 0.0:
            raise InvalidConfigError(f"watermark must be >= 0, got {watermark!r}")
        self.max_model_len = max_model_len
        self.scheduler_block_size: int = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.enable_caching = bool(enable_caching)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.use_eagle = bool(use_eagle)
        self.log_stats = bool(log_stats)
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats: Any = _compat.PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        interval = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
        if interval is not None and interval != 0:
            # vLLM's own checks, in its order; the scheduler block size is an
            # engine notion the core does not have (the core checks the rest).
            translated = translate_config(kv_cache_config, dcp_world_size)
            if not any(manager_kind_for(g.kv_cache_spec) in ("sliding_window", "mamba")
                       for g in translated.kv_cache_groups):
                raise InvalidConfigError(
                    "prefix_cache_retention_interval is set but this model has no sliding-window or "
                    "Mamba KV cache group, so retention has no effect (D-CFG-12)")
            if interval < 0 or interval % scheduler_block_size:
                raise InvalidConfigError(
                    f"prefix_cache_retention_interval ({interval}) must be non-negative and a "
                    f"multiple of scheduler_block_size ({scheduler_block_size})")
        setup = RetentionSetup(retention) if isinstance(retention, RetentionConfig) else retention
        if setup is not None and not isinstance(setup, RetentionSetup):
            raise InvalidConfigError(f"retention must be None, a RetentionSetup or a RetentionConfig, got {setup!r}")
        # Context parallelism is translated into the block sizes (vLLM 0.33 scales
        # only DCP-sharded groups, by the DCP size: D-VLLM-7), so the core runs at 1.
        self._core = CoreManager(
            translate_config(kv_cache_config, dcp_world_size), max_model_len,
            enable_caching=self.enable_caching,
            hash_block_size=hash_block_size if self.num_kv_cache_groups else None,
            use_eagle=self.use_eagle, log_stats=False,
            enable_kv_cache_events=self.enable_kv_cache_events,
            retention_interval=interval,
            max_num_batched_tokens=max_in_flight_tokens,
            num_hash_lookahead_tokens=self.num_hash_lookahead_tokens,
            num_prefill_lookahead=self.num_prefill_lookahead,
            retention=None if setup is None else setup.config)
        # Each request's retention directives, applied after its allocations (None: retention off).
        self._retention = None if setup is None else RequestRetention(self._core, setup)
        # vLLM's EAGLE resume checkpoint, narrowed as vLLM narrows it (D-MAMBA-40).
        resume = enable_partial_hits_where_vllm_would(self._core, dcp_world_size,
                                                      bool(enable_mamba_shared_prefix_checkpoint))
        self.block_pool = BlockPoolView(self._core.block_pool, self.enable_caching,
                                        hash_block_size, self._translate_events)
        self.coordinator = make_coordinator_view(self._core.coordinator, kv_cache_config,
                                                 self.block_pool, interval, self.enable_caching,
                                                 dcp_world_size)
        self.coordinator.scheduler_block_size = scheduler_block_size
        self._zeroing = ZeroingRecorder(kv_cache_config, self._core.coordinator.block_sizes)
        self.mamba_shared_prefix_checkpoint = resume
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self._event_metadata = tuple(
            (_compat.kv_cache_spec_kind(group.kv_cache_spec),
             _compat.kv_cache_spec_sliding_window(group.kv_cache_spec))
            for group in kv_cache_config.kv_cache_groups)
        self.empty_kv_cache_blocks: Any = _compat.KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)))
        # estimate_cached_tokens runs per waiting request per step: its group filter is fixed here.
        spec_classes = _compat.spec_classes()
        skipped = tuple(spec_classes[name] for name in (
            "CrossAttentionSpec", "EncoderOnlyAttentionSpec") if name in spec_classes)
        self._cached_token_groups: tuple[tuple[Any, int], ...] = tuple(
            (manager, manager.block_size) for group, manager in zip(
                kv_cache_config.kv_cache_groups, self._core.coordinator.managers)
            if getattr(group.kv_cache_spec, "prefix_cacheable", True)
            and not isinstance(group.kv_cache_spec, skipped))
        # Read per call by the hot methods (the core's properties are a call each).
        self._core_coordinator = self._core.coordinator
        self._core_pool = self._core.block_pool
        self._core_empty = self._core_coordinator.empty_blocks
        self._core_hashes = self._core_pool.block_hashes  # live: cleared in place, never replaced
        # Whether allocations record no blocks for zeroing (fixed by the config): the decode
        # and admission fast paths then apply.
        self._records_no_zeroing = not self._zeroing.groups
        # Whether new_step_starts has anything to tell the groups (fixed with the groups).
        self._has_step_hooks = self._core_coordinator.has_step_hooks
        # vLLM's Request counts its tokens as len(all_token_ids): an int >= 1 for a request the
        # core knows (vLLM refuses an empty prompt; tokens are only appended). The decode step
        # then skips that property call (D-PERF-22).
        self._core_coordinator.well_formed_request_types.add(_VLLM_REQUEST)
        # The several-group decode step snapshots a request it fills (D-PERF-37): vLLM's
        # Request the way this adapter's general path does (D-PERF-12).
        self._core_coordinator.request_facts_readers[_VLLM_REQUEST] = capture_request
        # One full-attention group hashed at its block size (the common model): the lookup of a
        # vLLM Request and get_blocks read the group's tables directly (D-PERF-13).
        managers = self._core_coordinator.managers
        self._single_blocks_of: dict[str, list[int]] | None = (
            managers[0].req_to_blocks if len(managers) == 1 else None)
        self._unitary_lookup: Any = None
        self._unitary_block_size = 0
        self._plain_full_attention = (type(self._core_coordinator) is UnitaryCoordinator
                                      and type(managers[0]) is FullAttentionManager)
        unitary = managers[0] if type(self._core_coordinator) is UnitaryCoordinator else None
        if isinstance(unitary, FullAttentionManager):  # always, on this coordinator
            self._unitary_lookup = unitary.find_longest_cache_hit
            self._unitary_block_size = managers[0].block_size

    # ---------------------------------------------------------- translation

    def _request(self, request: Any) -> Any:
        """The request as the core reads it: every ``RequestView`` attribute,
        LoRA ones included (the core reads them all once per call, D-API-24)."""
        return VllmRequestView(request)

    def create_kv_cache_blocks(self, blocks: Sequence[Sequence[Any]]) -> Any:
        """vLLM's ``KVCacheBlocks`` for per-group lists of block ids or block objects."""
        if not any(blocks):
            return self.empty_kv_cache_blocks
        view = self.block_pool.blocks.__getitem__
        if len(blocks) == 1 and type(blocks[0][0]) is int:
            # One group of ids: get_blocks per scheduled request, a new allocation's blocks.
            return _compat.KVCacheBlocks((list(map(view, blocks[0])),))
        return _compat.KVCacheBlocks(tuple(
            # Groups hold ids (the common case: one C-level map per group) or block objects.
            list(map(view, group)) if not group or type(group[0]) is int else
            [view(b) if type(b) is int else b for b in group] for group in blocks))

    def _vllm_blocks(self, core_blocks: Any) -> Any:
        return self.create_kv_cache_blocks(core_blocks.blocks)

    # ------------------------------------------------------------- stats

    @property
    def usage(self) -> float:
        return self._core.usage

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = _compat.PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        # prefix_cache_lookup_enabled, inlined (once per scheduled waiting request).
        if not self.log_stats or not self.enable_caching or request.skip_reading_prefix_cache:
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    # --------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
        *,
        tier_blocks: int = 0,
    ) -> Any:
        """Slots for ``num_new_tokens`` more tokens; None when they do not fit
        with ``reserved_blocks`` and, for a waiting request while others are
        scheduled, the watermark kept free (the whole request, with
        ``full_sequence_must_fit``, keeps the watermark only: D-API-48).
        ``tier_blocks`` (pagedkv's, not vLLM's): device blocks a host tier
        takes once this call returns, kept free beside both, as the watermark."""
        # The scheduler's commonest call, once per running request per step:
        # a plain decode step of vLLM's own Request, handed to the core's decode
        # step (the one that decides it; its C twin in a native build), which
        # reads the request itself, without the view (D-PERF-11): with events
        # off it reads only request_id, num_computed_tokens, num_tokens and
        # block_hashes, which vLLM's Request holds as the view would give them
        # (the step takes the general path for any other type). Everything
        # else is what the general path below passes for these arguments:
        # no hit, no reserved block or watermark, nothing in flight, no zeroing to record.
        zero = 0  # the cached int 0, as the core compares it
        if (type(request) is _VLLM_REQUEST and new_computed_blocks is None
                and num_new_computed_tokens is zero and num_lookahead_tokens is zero
                and num_external_computed_tokens is zero and num_encoder_tokens is zero
                and reserved_blocks is zero and tier_blocks is zero and not full_sequence_must_fit
                and type(num_new_tokens) is int and num_new_tokens >= 1
                and not self._core_pool.enable_kv_cache_events
                and not (has_scheduled_reqs and self.watermark_blocks and request.status in _compat.WAITING_STATES)
                and not request.num_in_flight_tokens):  # vLLM's Request sets it (0.32, 0.33)
            decode_step = self._core_coordinator.decode_step
            if decode_step is not None and self._records_no_zeroing:
                result = decode_step(request, num_new_tokens, delay_cache_blocks)
                if result is not TAKE_GENERAL_PATH:
                    if result is self._core_empty:
                        return self.empty_kv_cache_blocks
                    if result is None:
                        return None
                    # One group of new blocks (the only other result of a decode
                    # step): create_kv_cache_blocks' own case, without its frames (D-PERF-31).
                    new_ids = result.blocks
                    if len(new_ids) == 1 and new_ids[0]:
                        return _compat.KVCacheBlocks(
                            (list(map(self.block_pool.blocks.__getitem__, new_ids[0])),))
                    return self._vllm_blocks(result)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and (
                num_new_computed_tokens == 0):
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        watermark = tier_blocks  # plus vLLM's, for a waiting request while others are scheduled (D-VLLM-4)
        if has_scheduled_reqs and self.watermark_blocks and request.status in _compat.WAITING_STATES:
            watermark += self.watermark_blocks
        hit_ids: tuple[list[int], ...] | None = None
        if new_computed_blocks is not None and any(new_computed_blocks.blocks):
            # The ids of vLLM's block objects (or ids) of the hit, per group.
            hit_ids = tuple(map(hit_block_ids, new_computed_blocks.blocks))
        zeroing = self._zeroing
        before: tuple[int, ...] = ()
        if zeroing.groups:
            known = request.request_id in self._core_coordinator.requests
            before = zeroing.held_lengths(self._core.get_block_ids(request.request_id) if known else None)
        in_flight = getattr(request, "num_in_flight_tokens", 0) or 0
        core_request: Any
        if type(request) is _VLLM_REQUEST:
            admit_step = self._core_coordinator.admit_step
            if (admit_step is not None and not zeroing.groups and num_lookahead_tokens is zero
                    and num_external_computed_tokens is zero and num_encoder_tokens is zero
                    and (full_sequence_must_fit is False or full_sequence_must_fit is True)
                    and (hit_ids is None or len(hit_ids) == 1)):
                # A new request on one full-attention group: the core's admission step, as
                # its allocate_slots would call it for these arguments (D-PERF-20); it hands
                # anything else (a known request, a malformed count or hit) back. With events
                # off it reads four attributes, which vLLM's Request holds as the snapshot
                # would (D-PERF-23); events read the tokens and LoRA: the snapshot then.
                # Raw: the hit and the new blocks as lists of ids, no core result object
                # in between (D-PERF-34); a hit of several groups is malformed here: general.
                new_ids = admit_step(
                    capture_request(request) if self._core_pool.enable_kv_cache_events else request,
                    num_new_tokens, num_new_computed_tokens, None if hit_ids is None else hit_ids[0],
                    delay_cache_blocks, reserved_blocks, watermark, in_flight, full_sequence_must_fit, True)
                if new_ids is None:
                    return None
                if new_ids is not TAKE_GENERAL_PATH:
                    # create_kv_cache_blocks' own answer, without its frames (D-PERF-31).
                    return (_compat.KVCacheBlocks((list(map(self.block_pool.blocks.__getitem__, new_ids)),))
                            if new_ids else self.empty_kv_cache_blocks)
            # vLLM's own Request read straight into the core's snapshot (D-PERF-12).
            core_request = capture_request(request)
        else:
            core_request = self._request(request)
        # The core takes only its own KVCacheBlocks (D-API-25): the hit rebuilt from its ids.
        hit = None if hit_ids is None else CoreBlocks(hit_ids, self._core_hashes)
        new_blocks = self._core.allocate_slots(
            core_request, num_new_tokens, num_new_computed_tokens,
            hit, num_lookahead_tokens, num_external_computed_tokens,
            delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
            reserved_blocks=reserved_blocks, num_in_flight_tokens=in_flight,
            watermark_blocks=watermark)
        if new_blocks is None:
            return None
        if self._retention is not None:
            cached = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
            self._retention.after_allocation(
                request, 0 if delay_cache_blocks else min(cached + num_new_tokens, request.num_tokens))
        if zeroing.groups:
            zeroing.record_allocation(
                before, self._core.get_block_ids(request.request_id),
                None if hit is None else hit.get_block_ids(),
                num_loaded_tokens=(request.num_computed_tokens + num_new_computed_tokens
                                   + num_external_computed_tokens),
                skip_group_ids=skip_zeroing_group_ids)
        return self._vllm_blocks(new_blocks)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if self.enable_caching and request.request_id in self._core_coordinator.requests:
            self._core.cache_blocks(self._request(request), num_computed_tokens)
            if self._retention is not None:
                self._retention.after_allocation(request, num_computed_tokens)

    def free(self, request: Any) -> None:
        """Release the request's blocks (tail first); an unknown request is a no-op."""
        if self._retention is not None:
            self._retention.forget(request.request_id)
        if type(request) is _VLLM_REQUEST:
            # The core's free(request, missing_ok=True) for vLLM's Request, whose id is a
            # str, without the core's frame (once per finished request, D-PERF-34).
            request_id = request.request_id
            coordinator = self._core_coordinator
            if request_id in coordinator.requests:
                try:
                    coordinator.release(request_id)
                except BaseException:
                    recover(coordinator)  # as the core's free: a consistent manager (D-API-24)
                    raise
            return
        self._core.free(request, missing_ok=True)

    def pop_blocks_for_free(self, request: Any) -> list[BlockView]:
        """Forget the request but keep its blocks referenced until the caller
        passes them to ``block_pool.free_blocks`` (deferred frees). Composed
        from pagedkv operations: pin every block once more, then free the
        request; the returned blocks hold exactly the pin."""
        request_id = request.request_id
        if request_id not in self._core_coordinator.requests:
            return []
        ids = [block for group in self._core.get_block_ids(request_id) for block in group if block]
        if self._retention is not None:
            self._retention.forget(request_id)
        self._core_pool.touch(ids)
        self._core.free(request)
        return self.block_pool.views(ids)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if request_id in self._core.coordinator.requests:
            self._core.coordinator.remove_skipped_blocks(
                request_id=request_id, num_total_computed_tokens=processed_computed_tokens,
                num_prompt_tokens=num_prompt_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self._core.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        # Deprecated in vLLM 0.33 (cascade attention removed): zeros.
        return [0] * self.num_kv_cache_groups

    def __repr__(self) -> str:
        return f"pagedkv.vllm.KVCacheManager({self._core!r})"


# The HiSparse manager wraps this one around the device groups (set here: no import back).
HiSparseKVCacheManager.device_manager = KVCacheManager
