"""The per-step drains of ``pagedkv.vllm.KVCacheManager``: what vLLM 0.33's
scheduler collects once a step — the step hook, blocks to zero, copy-on-write
copies of sub-block hits, Mamba boundary-state and partial-tail offloads.
Each answers from the core; a mixin of the adapter's manager."""

from __future__ import annotations

from typing import Any

from pagedkv.optimized.manager import KVCacheManager as CoreManager

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
    _zeroing: ZeroingRecorder
    coordinator: Any
    block_pool: BlockPoolView

    def new_step_starts(self) -> None:
        self._core.new_step_starts()

    def take_new_block_ids(self) -> ZeroingBlockIds:
        """Blocks handed out since the last call that the worker zeroes (zeroing.py)."""
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
        return self._core.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """A finishing request's uncopied Mamba prompt tails (the core's, MTAIL-1)."""
        return self._core.finalize_partial_tail_offloads(
            request.request_id, request.num_computed_tokens, getattr(request, "num_in_flight_tokens", 0))
