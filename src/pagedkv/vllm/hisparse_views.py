"""vLLM 0.33's HiSparse objects, as views over pagedkv's host tier.

vLLM's HiSparse tests reach the host tier through ``get_hisparse_coordinator``
(which asserts vLLM's ``HiSparseCoordinator`` class) and the group managers it
binds (``req_to_blocks``, ``get_residency_row``, ``require_hot``, the host
pool). These classes answer from :class:`pagedkv.optimized.host_tier.hisparse.HostTierManager`;
every decision is the tier's (spec/host_tier.md), they only translate ids into
vLLM's block views and command records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from pagedkv.optimized.engine import BlockPool, HostTierManager, TierPool
from pagedkv.spec.hisparse import HostCacheEvent

from . import _compat
from .blocks import BlockPoolView

__all__ = ["HostBlockView", "HostPoolView", "SharedDevicePool", "host_events",
           "make_hisparse_coordinator"]


class _FreeBlocks:
    """The free queue of the main pool as the tier reads it (a count)."""

    def __init__(self, core: BlockPool) -> None:
        self._core = core

    def __len__(self) -> int:
        return self._core.get_num_free_blocks()

    def __bool__(self) -> bool:
        return self._core.get_num_free_blocks() > 0


class SharedDevicePool(TierPool):
    """The tier's device pool as pagedkv's main pool, which the indexer group
    shares (D-HOST-18): takes, holds and releases go to the main pool; the
    adapter reports the main pool's other takes with ``device_blocks_taken``."""

    def __init__(self, core: BlockPool) -> None:  # the parent's tables are not used
        self.core = core
        self.hash_of = {}
        self.cached = {}
        self.evicted = []
        self.ref = []

    @property
    def free(self) -> _FreeBlocks:  # type: ignore[override]  # read as a count only
        return _FreeBlocks(self.core)

    def take(self, n: int) -> list[int]:
        return self.core.get_new_blocks(n)

    def hold(self, b: int) -> None:
        self.core.touch([b])

    def release(self, b: int) -> None:
        self.core.free_blocks([b])

    def release_batch(self, blocks: list[int]) -> None:
        self.core.free_blocks(blocks)  # unhashed: to the front, as one batch

    def unpin(self, b: int) -> None:
        self.core.release_to_back([b])  # still read: reused last


class HostBlockView:
    """vLLM's ``KVCacheBlock`` for a block of the tier's host pool."""

    __slots__ = ("block_id", "_tier")

    def __init__(self, block_id: int, tier: HostTierManager) -> None:
        self.block_id = block_id
        self._tier = tier

    @property
    def ref_cnt(self) -> int:
        return self._tier.host.ref[self.block_id]

    @property
    def block_hash(self) -> Any:
        return self._tier.host.hash_of.get(self.block_id)

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        return f"HostBlockView({self.block_id}, ref_cnt={self.ref_cnt})"


class HostPoolView:
    """vLLM's host ``BlockPool`` (``get_host_block_pool``) over the tier's host pool."""

    def __init__(self, tier: HostTierManager) -> None:
        self._tier = tier
        self.blocks = [HostBlockView(b, tier) for b in range(tier.config.host_num_blocks)]
        self.null_block = self.blocks[0]
        self.num_gpu_blocks = tier.config.host_num_blocks

    def get_num_free_blocks(self) -> int:
        return self._tier.num_free_host_blocks()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._tier.evict_host_blocks(sorted(block_ids))

    def get_new_blocks(self, num_blocks: int) -> list[HostBlockView]:
        """Host blocks for a caller outside any request (``take_host``, D-HOST-23)."""
        taken = self._tier.take_host(num_blocks)
        if taken is None:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the host pool")
        return [self.blocks[b] for b in taken]

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Give back blocks ``get_new_blocks`` handed out (``free_host``)."""
        self._tier.free_host([int(block.block_id) for block in ordered_blocks])


class _Rows(Mapping[str, list[Any]]):
    """``req_to_blocks`` of one HiSparse group: request id -> block views."""

    def __init__(self, rows: Any, views: Any) -> None:
        self._rows = rows  # request id -> ids, read live
        self._views = views

    def __getitem__(self, request_id: str) -> list[Any]:
        return [self._views[b] for b in self._rows()[request_id]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())


class HiSparseGroupView:
    """One HiSparse group's manager (source, resident or hot) as vLLM's
    coordinator and tests read it; ``coordinator`` is the shared view."""

    def __init__(self, kind: str, spec: Any, group_id: int, tier: HostTierManager,
                 device: BlockPoolView, host: HostPoolView, table: dict[str, list[int]]) -> None:
        self.kind = kind
        self.kv_cache_spec = spec
        self.kv_cache_group_id = group_id
        self.block_size = int(spec.block_size)
        self.coordinator: Any = None
        self._tier = tier
        self.block_pool: Any = host if kind == "source" else device
        self.blocks_per_request = int(getattr(spec, "blocks_per_request", 0) or 0)
        if kind == "source":
            self.req_to_blocks: Mapping[str, list[Any]] = _Rows(
                lambda: {r: q.host_row for r, q in tier.requests.items()}, host.blocks)
        elif kind == "resident":
            # The append-only block table the engine was given (losses and
            # adoptions reach the worker as residency updates instead).
            self.req_to_blocks = _Rows(lambda: table, device.blocks)
        else:
            self.req_to_blocks = _Rows(
                lambda: {r: q.hot for r, q in tier.requests.items() if q.hot}, device.blocks)
        self._device = device

    # -- source --------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any,
        total_computed_tokens: int, num_local_computed_tokens: int,
        num_tokens_main_model: int, apply_admission_cap: bool = False, prefill_end: int = 0,
    ) -> int:
        """The source group's answer: 0 when the host pool can back the
        allocation (its blocks never count against the device pool), else
        vLLM's sentinel, one more than the device pool holds. Counted by the
        tier's ``capacity_needed`` (D-HOST-23); only the source group answers."""
        if self.kind != "source":
            raise NotImplementedError(f"the {self.kind} group's count is the tier's")
        hit = [int(block.block_id) for block in new_computed_blocks]
        held = request_id in self._tier.requests
        external = 0 if held else max(total_computed_tokens - num_local_computed_tokens, 0)
        host, _ = self._tier.capacity_needed(request_id, num_tokens, hit, external,
                                             num_local_computed_tokens if hit else None)
        if host <= self._tier.num_free_host_blocks():
            return 0
        return int(self._device.num_gpu_blocks) + 1

    # -- resident ------------------------------------------------------------
    def get_residency_row(self, request_id: str, start: int = 0) -> list[Any]:
        req = self._tier.requests.get(request_id)
        return [] if req is None else self._device.views(req.resident_row[start:])

    def get_resident_page(self, request_id: str, page: int) -> Any:
        req = self._tier.requests.get(request_id)
        if req is None or page >= len(req.resident_row) or req.resident_row[page] == 0:
            return None
        return self._device.blocks[req.resident_row[page]]

    # -- hot -----------------------------------------------------------------
    def require_hot(self, request_id: str) -> None:
        if request_id in self._tier.requests:
            self._tier.require_hot(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int = 0) -> list[Any]:
        """The hot region, when the request needs it and lacks it (an
        allocation of the pages it already holds takes just that)."""
        req = self._tier.requests.get(request_id)
        if self.kind != "hot" or req is None or req.hot or not req.hot_required:
            return []
        pages_tokens = len(req.host_row) * self._tier.config.block_size
        allocation = self._tier.allocate(request_id, min(num_tokens, pages_tokens))
        return [] if allocation is None else self._device.views(allocation.hot_blocks)

    @property
    def hot_required(self) -> set[str]:
        """Requests that asked for their hot region (read-only)."""
        return {r for r, q in self._tier.requests.items() if q.hot_required}

    def has_hot(self, request_id: str) -> bool:
        return request_id in self._tier.requests and self._tier.can_read_from_host(request_id)


class HiSparseCoordinatorView:
    """vLLM's ``HiSparseCoordinator`` over the host tier (see the module docstring)."""

    def __init__(self, tier: HostTierManager, groups: list[HiSparseGroupView],
                 host_group_id: int, host: HostPoolView, max_model_len: int,
                 num_reprefillable_tokens: int) -> None:
        self._tier = tier
        self.host_manager = next(g for g in groups if g.kind == "source")
        self.resident_managers = tuple(g for g in groups if g.kind == "resident")
        self.hot_managers = tuple(g for g in groups if g.kind == "hot")
        self.host_group_id = host_group_id
        self.has_host_cache = True
        self.max_model_len = max_model_len
        self.num_reprefillable_tokens = num_reprefillable_tokens
        self._host = host
        self._device = groups[0]._device
        self.gpu_pool: Any = None  # the manager's main pool view, set by the manager
        for group in groups:
            group.coordinator = self

    @property
    def copies(self) -> dict[Any, tuple[Any, ...]]:
        """Published host hash -> the device block holding a copy (read-only)."""
        blocks = self._device.blocks
        return {h: (blocks[b],) for h, b in self._tier.copies.items()}

    @property
    def transition_watermark(self) -> int:
        """Free device blocks below which a request without a hot region asks for one."""
        return self._tier.config.device_watermark

    @property
    def spills_to_send(self) -> list[int]:
        """Transfers planned and not yet sent (ids; read-only)."""
        return [t for t in self._tier.outbox if t in self._tier.transfers]

    @property
    def request_states(self) -> dict[str, Any]:
        """Per request, the clean pages as ``valid_pages`` (read-only)."""
        return {r: SimpleNamespace(valid_pages=set(q.clean), unpinned_pages=set(q.unpinned))
                for r, q in self._tier.requests.items()}

    @property
    def max_spill_pages(self) -> int:
        return self._tier.spill_budget

    @max_spill_pages.setter
    def max_spill_pages(self, value: int) -> None:
        self._tier.spill_budget = int(value)

    def get_host_block_pool(self) -> HostPoolView:
        return self._host

    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        for request_id, num_tokens in requests:
            if request_id in self._tier.requests:
                self._tier.advance(request_id, num_tokens)

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        if request_id in self._tier.requests:
            budget = max(self._tier.spill_budget - len(self._tier.outbox), 0)
            self._tier.plan_writebacks(request_id, num_computed_tokens, budget)

    def update_residency(self, request_id: str) -> None:
        if request_id in self._tier.requests:
            self._tier.update_residency(request_id)

    def build_offload_command(self) -> Any:
        types = _compat.hisparse_classes()
        transfers = [types["SparseKVPageTransfer"](
            transfer_id=t.transfer_id, host_block_id=t.host_block,
            resident_block_ids=(t.device_block,), after_forward=t.kind == "writeback",
            restore=t.kind == "restore") for t in self._tier.take_transfers()]
        return types["SparseKVOffloadCommand"](page_transfers=transfers)

    def update_spills(self, enqueued_counts: Mapping[int, int],
                      completed_counts: Mapping[int, int]) -> None:
        self._tier.report_transfers(dict(enqueued_counts), dict(completed_counts))

    def build_row_mirrors(self, requests: Iterable[tuple[str, int, int]]) -> tuple[Any, ...]:
        mirror = _compat.hisparse_classes()["SparseKVRowMirror"]
        return tuple(
            mirror(source_starts=(m.device_slot,), destination_start=m.host_slot,
                   num_rows=m.num_rows)
            for request_id, computed, scheduled in requests if request_id in self._tier.requests
            for m in self._tier.row_mirrors(request_id, computed, scheduled))

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        size = self._tier.config.block_size
        for request_id, computed, scheduled in requests:
            req = self._tier.requests.get(request_id)
            if req is None or len(req.resident_row) < -(-(computed + scheduled) // size):
                return False
            if not self._tier.fully_resident(request_id):
                return False
        return True

    def take_residency_updates(self, request_ids: Iterable[str]) -> dict[str, Any]:
        update = _compat.hisparse_classes()["SparseKVResidencyUpdate"]
        known = [r for r in request_ids if r in self._tier.requests]
        return {r: update(pages=list(u.pages), block_ids=(list(u.block_ids),))
                for r, u in self._tier.take_residency_updates(known).items()}

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        req = self._tier.requests.get(request_id)
        if req is not None and req.importing:
            self._tier.finish_import(request_id, failed)

    def has_pending_work(self) -> bool:
        return bool(self._tier.transfers)

    def has_pending_reclamation(self) -> bool:
        tier = self._tier
        return any(tier.host.ref[t.host_block] == 1 or (
            t.request_id in tier.requests and tier.can_read_from_host(t.request_id))
            for t, _ in tier.transfers.values())

    def take_host_block_copies(self) -> tuple[Any, ...]:
        return ()  # host copy-on-write is not modelled (D-HOST-15)

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        del dst_block_ids


def make_hisparse_coordinator(*args: Any) -> HiSparseCoordinatorView:
    """The coordinator view, posing as vLLM's ``HiSparseCoordinator``."""
    view_class = _compat.posing_as(HiSparseCoordinatorView,
                                   _compat.hisparse_classes().get("HiSparseCoordinator"))
    view: HiSparseCoordinatorView = view_class(*args)
    return view


def host_events(events: Iterable[HostCacheEvent], request_of: Any, group_idx: int,
                spec: Any) -> list[Any]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` events, medium CPU, for the
    tier's host cache changes (D-HOST-26). ``request_of(event)`` is the vLLM
    request that published a ``stored`` event (its tokens and LoRA), or None."""
    medium = "CPU"  # vLLM's MEDIUM_CPU
    size = int(spec.block_size)
    out: list[Any] = []
    for event in events:
        if event.kind == "removed":
            out.extend(_compat.BlockRemoved(block_hashes=[_compat.external_block_hash(h)],
                                            medium=medium, group_idx=group_idx)
                       for h in event.block_hashes)
            continue
        request = request_of(event)
        lora = None if request is None else request.lora_request
        tokens = [] if request is None else list(request.all_token_ids[
            event.first_page * size:(event.first_page + len(event.block_hashes)) * size])
        stored = _compat.BlockStored(
            block_hashes=[_compat.external_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if event.parent_hash is None
            else _compat.external_block_hash(event.parent_hash),
            token_ids=tokens, block_size=size,
            lora_id=None if lora is None else int(lora.adapter_id),
            medium=medium, lora_name=None if lora is None else str(lora.name),
            group_idx=group_idx,
            **_compat.block_stored_hash_inputs(None, None, len(event.block_hashes)))
        stored.kv_cache_spec_kind = _compat.kv_cache_spec_kind(spec)
        stored.kv_cache_spec_sliding_window = _compat.kv_cache_spec_sliding_window(spec)
        out.append(stored)
    return out
