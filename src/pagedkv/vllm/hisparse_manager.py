"""vLLM 0.33's ``KVCacheManager`` for a HiSparse configuration, on pagedkv.

A HiSparse ``KVCacheConfig`` has a host-resident source group, device groups
(the indexer) and the derived resident and hot groups. This manager composes
pagedkv's own vLLM adapter over the device groups with the optimized host tier
(spec/host_tier.md) whose device pool is the adapter's main pool (D-HOST-18):
the tier takes, holds and releases blocks there, and every block the main pool
hands out elsewhere (an indexer allocation, a caller's ``get_new_blocks``) is
reported to the tier, which loses the pages still reading it. Group ids are
vLLM's. What is not served yet (D-HOST-15): several resident or hot groups,
host prefix hits, imports from a connector, host copy-on-write.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedkv.optimized.engine import HostTierManager, full_sequence_need
from pagedkv.spec.allocate_args import check_counts

from . import _compat
from .config import UnsupportedVllmSpecError
from .hisparse import translate_hisparse_config
from .hisparse_views import (
    HiSparseGroupView,
    HostPoolView,
    SharedDevicePool,
    host_events,
    make_hisparse_coordinator,
)

__all__ = ["HiSparseKVCacheManager"]


class _NotifyingPool:
    """The main pool's view; blocks a caller takes are reported to the tier,
    and a deferred free's blocks (``pop_blocks_for_free``) come back here."""

    def __init__(self, view: Any, tier: HostTierManager) -> None:
        self._view = view
        self._tier = tier
        # Outstanding fence holds: fence id -> the views handed out for it,
        # and the ids of those a partial free already named.
        self.fences: dict[int, list[Any]] = {}
        self._freed: dict[int, set[int]] = {}

    def free_blocks(self, ordered_blocks: Any) -> None:
        """Release blocks: a fence hold goes back to the tier as one
        (``release_fence``) once every one of its blocks has been named, in
        this call or earlier ones (a caller may free a hold in parts; its
        blocks stay held until the last part); the rest are the main pool's."""
        blocks = list(ordered_blocks)
        named = {id(block) for block in blocks}
        for fence_id, held in list(self.fences.items()):
            mine = {id(block) for block in held} & named
            if not mine:
                continue
            named -= mine
            self._freed.setdefault(fence_id, set()).update(mine)
            if len(self._freed[fence_id]) == len({id(block) for block in held}):
                self._tier.release_fence(fence_id)
                del self.fences[fence_id], self._freed[fence_id]
        self._view.free_blocks([b for b in blocks if id(b) in named])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        blocks: list[Any] = self._view.get_new_blocks(num_blocks)
        self._tier.device_blocks_taken([block.block_id for block in blocks])
        return blocks


class _CoordinatorView:
    """``manager.coordinator``: vLLM's group managers in vLLM's group order."""

    def __init__(self, managers: list[Any], num_reprefillable_tokens: int,
                 owner: HiSparseKVCacheManager) -> None:
        self.single_type_managers = managers
        self.num_reprefillable_tokens = num_reprefillable_tokens
        self.enable_partial_hash_hits = False
        self.eagle_group_ids: tuple[int, ...] = ()
        self.retention_interval: int | None = None
        self._owner = owner

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any,
        num_encoder_tokens: int, total_computed_tokens: int, num_local_computed_tokens: int = 0,
        num_tokens_main_model: int | None = None, apply_admission_cap: bool = False,
        prefill_end: int | None = None,
    ) -> int:
        """Device blocks the allocation would take: the device groups' and the
        tier's (capped at the admission window with ``apply_admission_cap``,
        D-HOST-11); a host shortfall reads as ``num_gpu_blocks + 1``, as vLLM's."""
        owner = self._owner
        tier = owner._tier
        groups = list(new_computed_blocks)
        device = owner._inner.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens, [groups[i] for i in owner._device_ids], num_encoder_tokens,
            total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
            apply_admission_cap, prefill_end)
        # Tokens a connector loads: only a request the tier does not hold imports.
        external = 0 if request_id in tier.requests else max(
            total_computed_tokens - num_local_computed_tokens, 0)
        hit = owner._retained_hit(groups, num_local_computed_tokens, external)
        if apply_admission_cap and request_id in tier.requests:
            host, tier_device = tier.full_sequence_blocks(request_id, num_tokens)
        else:  # a capacity query: the hit is counted as given (D-HOST-23)
            host, tier_device = tier.capacity_needed(
                request_id, num_tokens, hit, external, num_local_computed_tokens if hit else None)
        if host > tier.num_free_host_blocks():
            return int(owner.kv_cache_config.num_blocks) + 1
        return int(device) + tier_device

    def find_longest_cache_hit_per_group(
            self, block_hashes: Any,
            max_cache_hit_length: int) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
        """Each group's own hit, as a connector bounds its loads: the host
        cache's for the source group, the device groups' own, none for the
        resident and hot groups (their pages are the source group's)."""
        owner = self._owner
        hits, lengths = owner._inner.coordinator.find_longest_cache_hit_per_group(
            block_hashes, max_cache_hit_length)
        host = owner._host_hit(block_hashes, max_cache_hit_length)
        device = iter(zip(hits, lengths, strict=True))
        blocks: list[list[Any]] = []
        per_group: list[int] = []
        for kind in owner._kinds:
            group_blocks, length = next(device) if kind == "device" else (
                (host, len(host) * owner._tier.config.block_size) if kind == "source" else ([], 0))
            blocks.append(list(group_blocks))
            per_group.append(int(length))
        return tuple(blocks), tuple(per_group)


def _regroup(event: Any, device_ids: list[int]) -> Any:
    group_idx = getattr(event, "group_idx", None)
    if group_idx is None or not 0 <= group_idx < len(device_ids):
        return event
    fields = {name: getattr(event, name) for name in type(event).__struct_fields__}
    fields["group_idx"] = device_ids[group_idx]
    return type(event)(**fields)


def _kind(group: Any) -> str:
    name = type(group.kv_cache_spec).__name__
    if getattr(group, "host_resident", False):
        return "source"
    return {"HiSparseResidentSpec": "resident", "HiSparseHotSpec": "hot"}.get(name, "device")


class HiSparseKVCacheManager:
    """See the module docstring; built by ``pagedkv.vllm.KVCacheManager`` for
    a config with ``hisparse_host_num_blocks``."""

    device_manager: Any = None
    """The adapter's ``KVCacheManager``, which serves the device groups; that
    module sets it, so this one need not import it back."""

    def __init__(self, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, num_prefill_lookahead: int = 0,
                 **kwargs: Any) -> None:
        groups = list(kv_cache_config.kv_cache_groups)
        kinds = [_kind(group) for group in groups]
        if kinds.count("resident") != 1 or kinds.count("hot") != 1:
            raise UnsupportedVllmSpecError(
                "pagedkv's host tier models one resident and one hot group (D-HOST-2); this "
                f"HiSparse config has {kinds.count('resident')} and {kinds.count('hot')}")
        self._device_ids = [i for i, kind in enumerate(kinds) if kind == "device"]
        inner_config = dataclasses.replace(
            kv_cache_config, kv_cache_groups=[groups[i] for i in self._device_ids],
            hisparse_host_num_blocks=None)
        self._inner = self.device_manager(inner_config, max_model_len, scheduler_block_size,
                                          hash_block_size, max_in_flight_tokens, enable_caching,
                                          num_prefill_lookahead=num_prefill_lookahead, **kwargs)
        _, config = translate_hisparse_config(kv_cache_config, max_model_len, enable_caching,
                                              max_in_flight_tokens, num_prefill_lookahead)
        # Host-medium events need the publishing requests' tokens: kept while
        # the tier may still publish for them (a finished one: its late pages).
        self._events = bool(kwargs.get("enable_kv_cache_events")) and enable_caching
        config = dataclasses.replace(config, record_events=self._events)
        self._requests: dict[str, Any] = {}
        self._detached_requests: dict[str, Any] = {}
        self._tier = HostTierManager(config, SharedDevicePool(self._inner._core.block_pool))
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.num_kv_cache_groups = len(groups)
        self.block_pool = _NotifyingPool(self._inner.block_pool, self._tier)
        self._host = HostPoolView(self._tier)
        self._kinds = kinds
        # The resident group's append-only block table (ids; 0 = a host-only page).
        self._table: dict[str, list[int]] = {}
        device_views = iter(self._inner.coordinator.single_type_managers)
        managers: list[Any] = []
        hisparse: list[HiSparseGroupView] = []
        for group_id, (group, kind) in enumerate(zip(groups, kinds, strict=True)):
            if kind == "device":
                managers.append(next(device_views))
                continue
            view = HiSparseGroupView(kind, group.kv_cache_spec, group_id, self._tier,
                                     self._inner.block_pool, self._host, self._table)
            managers.append(view)
            hisparse.append(view)
        reprefill = config.num_reprefillable_tokens
        view_class = _compat.posing_as(_CoordinatorView, _compat.vllm_coordinator_class(
            enable_caching, len(groups)))
        self.coordinator = view_class(managers, reprefill, self)
        self.hisparse_coordinator = make_hisparse_coordinator(
            self._tier, hisparse, kinds.index("source"), self._host, max_model_len, reprefill)
        self.hisparse_coordinator.gpu_pool = self.block_pool
        self.empty_kv_cache_blocks = _compat.KVCacheBlocks(tuple(() for _ in groups))

    def __getattr__(self, name: str) -> Any:
        # Engine-facing calls this manager does not reshape go to the device groups' adapter.
        return getattr(self._inner, name)

    def _blocks(self, device: Any, host: Any, resident: Any, hot: Any) -> Any:
        device_groups = iter(device)
        per_group: list[list[Any]] = []
        for kind in self._kinds:
            per_group.append(list(next(device_groups)) if kind == "device" else {
                "source": host, "resident": resident, "hot": hot}[kind])
        return _compat.KVCacheBlocks(tuple(per_group))

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, reserved_blocks: int = 0,
                       **kwargs: Any) -> Any:
        """Both parts or neither: the tier's needs are checked first and kept
        free while the device groups allocate, then the tier allocates. The
        tier's step need and ``reserved_blocks`` are kept free beside the
        step's blocks (``tier_blocks``; the device groups' adapter then gates
        the step only); with ``full_sequence_must_fit`` the whole request is
        gated here first, as vLLM 0.33 counts it (D-HOST-28). Malformed
        counts raise the core's typed error before either tier reads them."""
        request_id = request.request_id
        # Check 1a/1b (spec/allocate_args.py) first: the tier's counts and the
        # whole-request gate run before the device groups' adapter validates.
        # Whether the request is known is the device adapter's check (1b″).
        check_counts(request, True, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                     num_external_computed_tokens, num_encoder_tokens, reserved_blocks,
                     getattr(request, "num_in_flight_tokens", 0) or 0)
        total = min(request.num_computed_tokens + num_new_computed_tokens
                    + num_external_computed_tokens + num_new_tokens + num_lookahead_tokens,
                    self.max_model_len)
        hit: list[int] = []
        device_hit = None
        external = num_external_computed_tokens
        local = request.num_computed_tokens + num_new_computed_tokens
        if new_computed_blocks is not None and any(new_computed_blocks.blocks):
            groups = new_computed_blocks.blocks
            hit = self._retained_hit(groups, local, external)
            device_hit = self._inner.create_kv_cache_blocks(
                [list(groups[i]) for i in self._device_ids])
        hashes = list(request.block_hashes)
        local_tokens = local if hit else None
        host_need, device_need = self._tier.blocks_needed(request_id, total, hit, hashes, external,
                                                          local_tokens)
        free_host = self._tier.num_free_host_blocks()
        if host_need > free_host:
            return None
        if kwargs.pop("full_sequence_must_fit", False) and not self._whole_request_fits(
                request, hit, external, local_tokens, device_hit, num_lookahead_tokens,
                num_encoder_tokens, bool(kwargs.get("has_scheduled_reqs", True))):
            return None
        device = self._inner.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, device_hit, num_lookahead_tokens,
            external, delay_cache_blocks, num_encoder_tokens,
            tier_blocks=reserved_blocks + device_need, **kwargs)
        if device is None:
            return None
        self._tier.device_blocks_taken([b.block_id for group in device.blocks for b in group])
        allocation = self._tier.allocate(request_id, total, hit, hashes, external, local_tokens)
        assert allocation is not None, "checked above: both pools had room"
        if self._events:
            self._requests[request_id] = request
        # Host-only pages (a hit's, an import's) are null in the table the engine gets.
        # (adopted copies are residency, not table, entries: vLLM's split).
        row = self._tier.requests[request_id].resident_row
        table = self._table.setdefault(request_id, [])
        table.extend([0] * (len(row) - len(table) - len(allocation.resident_blocks)))
        table.extend(allocation.resident_blocks)
        views = self._inner.block_pool.blocks
        return self._blocks(device.blocks,
                            [self._host.blocks[b] for b in allocation.host_blocks],
                            [views[b] for b in allocation.resident_blocks],
                            [views[b] for b in allocation.hot_blocks])

    def get_computed_blocks(self, request: Any,
                            max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """The hit both tiers hold: the device groups' and the host cache's
        leading blocks, cut to the shorter (the last token is always computed)."""
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0, 0
        device, num_device, _ = self._inner.get_computed_blocks(request, max_cache_hit_length)
        limit = request.num_tokens - 1
        if max_cache_hit_length is not None:
            limit = min(limit, max_cache_hit_length)
        host = self._host_hit(request.block_hashes, limit)
        size = self._tier.config.block_size
        num_hit = min(num_device, len(host) * size) if self._device_ids else len(host) * size
        if not host:
            return self.empty_kv_cache_blocks, 0, 0
        # The host hit is kept whole, past the hit every group holds (vLLM's
        # retained longer hit): a connector load of the device groups' part
        # can complete it, and allocate_slots keeps only what is reused.
        device = self._inner.truncate_computed_blocks(device, num_hit)
        return self._blocks(device.blocks, host, [], []), num_hit, 0

    def _whole_request_fits(self, request: Any, hit: list[int], external: int,
                            local_tokens: int | None, device_hit: Any, num_lookahead_tokens: int,
                            num_encoder_tokens: int, has_scheduled_reqs: bool) -> bool:
        """The whole-request gate (``full_sequence_must_fit``), counted as
        vLLM 0.33 counts it (D-HOST-28): the host blocks of every page of the
        whole sequence, and on the device the device groups' whole-request
        blocks (the core's admission count) plus the tier's whole-sequence
        device need (resident pages up to the admission window, the hot
        region where one is due), with the watermark only: ``reserved_blocks``
        and the tier's step need guard the step, not the whole request."""
        tokens = min(request.num_tokens, self.max_model_len)
        if request.request_id in self._tier.requests:
            host, tier_device = self._tier.full_sequence_blocks(request.request_id, tokens)
        else:
            host, tier_device = self._tier.capacity_needed(
                request.request_id, tokens, hit, external, local_tokens)
            if not external:  # an import keeps its pages writable uncapped, as vLLM's
                tier_device = full_sequence_need(self._tier.config, tokens, held_pages=len(hit),
                                                 hot_missing=bool(hit))[1]
        if host > self._tier.num_free_host_blocks():
            return False  # every page of the whole sequence needs a host block (D-HOST-11)
        inner = self._inner
        hits = None if device_hit is None else tuple(
            [int(block.block_id) for block in group] for group in device_hit.blocks)
        device = inner._core_coordinator.full_sequence_demand(
            request_id=request.request_id,
            num_tokens=min(request.num_tokens + num_lookahead_tokens, self.max_model_len),
            new_computed_blocks=hits if hits and any(hits) else None,
            num_encoder_tokens=num_encoder_tokens)
        watermark = 0
        if has_scheduled_reqs and request.status in _compat.WAITING_STATES:
            watermark = int(inner.watermark_blocks)
        return bool(device + tier_device + watermark <= inner.block_pool.get_num_free_blocks())

    def _host_hit(self, block_hashes: Any, max_length: int) -> list[Any]:
        """The host cache's hit on these hashes, whole pages up to ``max_length`` tokens."""
        size = self._tier.config.block_size
        return [self._host.blocks[b]
                for b in self._tier.lookup(list(block_hashes))[:max(max_length, 0) // size]]

    def _retained_hit(self, groups: Any, num_local_tokens: int, num_external_tokens: int,
                      ) -> list[int]:
        """The host hit an allocation takes: the pages the local hit and the
        connector's load cover (vLLM cuts its retained hit there)."""
        size = self._tier.config.block_size
        reused = -(-(num_local_tokens + num_external_tokens) // size)
        return [int(b.block_id) for b in groups[self._kinds.index("source")][:reused]]

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        """Forget the request, keeping referenced what a step still in flight
        may write until the caller frees the returned blocks through
        ``block_pool.free_blocks``: the device groups' blocks (pinned by their
        adapter) and the tier's fence hold (D-HOST-16)."""
        request_id = request.request_id
        self._table.pop(request_id, None)
        device = self._inner.pop_blocks_for_free(request)
        if request_id not in self._tier.requests:
            return list(device)
        hold = self._tier.pop_for_free(request_id, finished=bool(request.is_finished()))
        self._forget_request(request_id)
        views = self._inner.block_pool.blocks
        held = [self._host.blocks[b] for b in hold.host_blocks] + [
            views[b] for b in hold.resident_blocks + hold.hot_blocks]
        self.block_pool.fences[hold.fence_id] = held
        return held + list(device)

    def take_events(self) -> list[Any]:
        """The device groups' events, their group ids made vLLM's (the device
        groups' adapter numbers only its own groups)."""
        events: list[Any] = [_regroup(event, self._device_ids) for event in self._inner.take_events()]
        if not self._events:
            return events
        source = self._kinds.index("source")
        events.extend(host_events(
            self._tier.take_host_events(), lambda e: (
                self._detached_requests if e.detached else self._requests).get(e.request_id),
            source, self.kv_cache_config.kv_cache_groups[source].kv_cache_spec))
        detached = {req.request_id for req in self._tier.detached}
        for request_id in [r for r in self._detached_requests if r not in detached]:
            del self._detached_requests[request_id]  # its late publication happened
        return events

    def _forget_request(self, request_id: str) -> None:
        """The tier freed the request: keep its vLLM request only while a late
        publication of it may still produce an event."""
        request = self._requests.pop(request_id, None)
        if request is not None and any(r.request_id == request_id for r in self._tier.detached):
            self._detached_requests[request_id] = request

    def reset_prefix_cache(self) -> bool:
        """Both caches or neither: refused while a host block is held, then
        the device groups' cache (which refuses while blocks are held)."""
        if any(self._tier.host.ref[1:]) or not self._inner.reset_prefix_cache():
            return False
        return self._tier.reset_host_cache()

    def get_blocks(self, request_id: str) -> Any:
        req = self._tier.requests.get(request_id)
        if req is None:
            return self.empty_kv_cache_blocks
        views = self._inner.block_pool.blocks
        return self._blocks(self._inner.get_blocks(request_id).blocks,
                            [self._host.blocks[b] for b in req.host_row],
                            [views[b] for b in self._table.get(request_id, [])],
                            [views[b] for b in req.hot])

    def create_kv_cache_blocks(self, blocks: Any) -> Any:
        """vLLM's ``KVCacheBlocks`` for per-group lists (vLLM's group order) of
        block ids or block objects: the source group's ids name host blocks."""
        if not any(blocks):
            return self.empty_kv_cache_blocks
        pools = {"source": self._host.blocks}
        device = self._inner.block_pool.blocks
        return _compat.KVCacheBlocks(tuple(
            [pools.get(kind, device)[b] if type(b) is int else b for b in group]
            for kind, group in zip(self._kinds, blocks, strict=True)))

    def get_computed_blocks_for_connector(
            self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int, bool]:
        """A HiSparse config has no Mamba group: the common hit, never divergent."""
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups  # as the device adapter: cascade attention is gone

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        """Each group's ids cut to the computed tokens; the resident and hot
        groups (not attention specs in vLLM) are left whole."""
        device = iter(self._inner.get_block_ids_for_computed_tokens(request_id, num_computed_tokens))
        pages = -(-num_computed_tokens // self._tier.config.block_size)
        return tuple(next(device) if kind == "device" else ids[:pages] if kind == "source" else ids
                     for kind, ids in zip(self._kinds, self.get_block_ids(request_id), strict=True))

    def get_block_ids(self, request_id: str, *args: Any, **kwargs: Any) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group]
                     for group in self.get_blocks(request_id).blocks)

    def free(self, request: Any) -> None:
        request_id = request.request_id
        if request_id in self._tier.requests:
            self._tier.free(request_id, finished=bool(request.is_finished()))
            self._forget_request(request_id)
        self._table.pop(request_id, None)
        self._inner.free(request)
