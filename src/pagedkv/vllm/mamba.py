"""vLLM's ``MambaManager`` attributes, as views of pagedkv's Mamba group manager.

vLLM's tests (and a worker computing where to export prefill checkpoints)
read a Mamba group manager's ``_checkpoints`` (request id -> the position
and block column its latest allocation reserved), ``cache_hit_alignment_tokens``
and its cache mode. This view answers from the core manager's own state
(spec/mamba.md); it decides nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pagedkv.optimized.mamba import MambaManager as CoreMambaManager

from .blocks import BlockPoolView
from .coordinator import GroupManagerView

__all__ = ["MambaManagerView", "CoreMambaManager"]


class _Checkpoints(Mapping[str, tuple[int, int]]):
    """``_checkpoints``: read-only, live over the core's table."""

    def __init__(self, core: CoreMambaManager) -> None:
        self._core = core

    def __getitem__(self, request_id: str) -> tuple[int, int]:
        return self._core.checkpoints[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._core.checkpoints)

    def __len__(self) -> int:
        return len(self._core.checkpoints)


class MambaManagerView(GroupManagerView):
    """A Mamba group's manager as vLLM's tests read it."""

    def __init__(self, core: CoreMambaManager, vllm_spec: Any, group_id: int,
                 pool: BlockPoolView, dcp_world_size: int = 1) -> None:
        super().__init__(core, vllm_spec, group_id, pool, dcp_world_size)
        self.mamba_core = core
        self.mamba_cache_mode = core.mode
        self.num_speculative_blocks = core.num_speculative_blocks
        self._checkpoints = _Checkpoints(core)

    @property
    def cache_hit_alignment_tokens(self) -> int:
        """Token granularity of the group's checkpoints (MCKPT-4)."""
        return self.mamba_core.cache_hit_alignment_tokens

    @property
    def has_prefill_checkpoint_blocks(self) -> bool:
        return self.mamba_core.has_checkpoints

    @property
    def drop_eagle_checkpoint_block(self) -> bool:
        return self.mamba_core.drop_eagle_checkpoint
