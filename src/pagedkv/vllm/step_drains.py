"""The per-step drains of ``pagedkv.vllm.KVCacheManager``: what vLLM 0.33's
scheduler collects once a step — the step hook, kv-cache events, blocks to
zero, copy-on-write copies of sub-block hits, Mamba boundary-state and
partial-tail offloads.
Each answers from the core; a mixin of the adapter's manager."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedkv.optimized.engine import BlockPool
from pagedkv.optimized.engine import KVCacheManager as CoreManager
from pagedkv.spec.types import AllBlocksCleared as CoreAllBlocksCleared
from pagedkv.spec.types import BlockRemoved as CoreBlockRemoved
from pagedkv.spec.types import BlockStored as CoreBlockStored

from . import _compat
from .blocks import BlockPoolView
from .coordinator import ZeroingBlockIds
from .mamba import take_block_copies
from .zeroing import ZeroingRecorder

__all__ = ["StepDrains"]


class StepDrains:
    """Mixin: needs the adapter's core manager, its coordinator and the
    views over them (``KVCacheManager.__init__`` sets them)."""

    _core: CoreManager
    _core_coordinator: Any
    _core_pool: BlockPool
    _event_metadata: tuple[tuple[Any, Any], ...]
    num_kv_cache_groups: int
    _zeroing: ZeroingRecorder
    _records_no_zeroing: bool
    _has_step_hooks: bool
    coordinator: Any
    block_pool: BlockPoolView

    def new_step_starts(self) -> None:
        # Only groups with a step hook (Mamba's) do anything: with none, no call
        # (once per step, D-PERF-32); the core manager's own hook only forwards.
        if self._has_step_hooks:
            self._core_coordinator.new_step_starts()

    def take_new_block_ids(self) -> ZeroingBlockIds:
        """Blocks handed out since the last call that the worker zeroes (zeroing.py)."""
        if self._records_no_zeroing:
            return []  # nothing is ever recorded (once per step: no call, D-PERF-32)
        return self._zeroing.take()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Zero the request's blocks from ``start_token`` on again (a failed load)."""
        if self._zeroing.groups and request_id in self._core_coordinator.requests:
            self._zeroing.record_from(self._core.get_block_ids(request_id), start_token)

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Copy-on-write copies of sub-block hits and the blocks they retain
        (spec/mamba.md, MPART-3); the scheduler frees those after the copy ran."""
        groups = self.coordinator.single_type_managers
        if not self._core_coordinator.mamba_managers:
            # Once per step, the common case: nothing to copy (a loop: no generator to build).
            for group in groups:
                if group._pending_cow_copies:
                    break
            else:
                return [], []
        return take_block_copies(self._core, [group._pending_cow_copies for group in groups],
                                 self.block_pool)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba ``align`` boundary states cached since the last call (the core's, MOFF-1)."""
        if not self._core_coordinator.mamba_managers:
            return {}  # only Mamba groups offer any (once per step: no call, D-PERF-32)
        return self._core.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """A finishing request's uncopied Mamba prompt tails (the core's, MTAIL-1)."""
        return self._core.finalize_partial_tail_offloads(
            request.request_id, request.num_computed_tokens, getattr(request, "num_in_flight_tokens", 0))

    def _translate_events(self, events: Iterable[Any]) -> Iterable[Any]:
        for event in events:
            if isinstance(event, CoreBlockStored):
                yield _compat.BlockStored(
                    block_hashes=[_compat.external_block_hash(h) for h in event.block_hashes],
                    parent_block_hash=None if event.parent_block_hash is None
                    else _compat.external_block_hash(event.parent_block_hash),
                    token_ids=list(event.token_ids), block_size=event.block_size,
                    lora_id=event.lora_id, medium=event.medium, lora_name=event.lora_name,
                    group_idx=event.group_idx, session_id=event.session_id,
                    **_compat.block_stored_hash_inputs(event.extra_keys, event.lookahead_token_ids,
                                                       len(event.block_hashes)))
            elif isinstance(event, CoreBlockRemoved):
                for block_hash in event.block_hashes:
                    yield _compat.BlockRemoved(
                        block_hashes=[_compat.external_block_hash(block_hash)],
                        medium=event.medium,
                        group_idx=event.group_idx)
            elif isinstance(event, CoreAllBlocksCleared):
                yield _compat.AllBlocksCleared()
            else:
                # An event already in vLLM's form (put on ``kv_event_queue`` by
                # the engine or a test) goes out as it is.
                yield event

    def take_events(self) -> list[Any]:
        events = self._core_pool.take_events()
        if not events:  # the common case, once per step: no translation, no loop, no lookups
            return events  # an empty list the pool no longer holds, as block_pool.take_events gives
        events = list(self._translate_events(events))
        for event in events:
            group = getattr(event, "group_idx", None)
            if not isinstance(event, _compat.BlockStored) or group is None:
                continue
            if 0 <= group < len(self._event_metadata):
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = (
                    self._event_metadata[group])
            else:
                # As vLLM 0.33: the event goes out unannotated, with a warning
                # on vLLM's manager logger (looked up now: tests replace it).
                _compat.kv_cache_manager_logger().warning(
                    "Group index `%s` not in KV cache metadata", group)
        return events
