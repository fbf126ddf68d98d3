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
from pagedkv.spec.errors import InvalidConfigError

from . import _compat
from .blocks import BlockPoolView
from .coordinator import GroupManagerView

__all__ = ["MambaManagerView", "CoreMambaManager", "enable_partial_hits_where_vllm_would",
           "take_block_copies"]


def enable_partial_hits_where_vllm_would(core: Any, dcp_world_size: int) -> None:
    """Turn the core's sub-block hits on where vLLM 0.33 enables
    ``enable_partial_hash_hits`` and pagedkv supports them (D-MAMBA-14,
    D-MAMBA-15, D-MAMBA-21); elsewhere they stay off and the scheduler never
    splits chunks for them. The core's block sizes are already scaled for
    DCP; its size widens which Mamba groups qualify (D-MAMBA-20)."""
    if not core.enable_caching:
        return
    try:
        core.enable_partial_hash_hits(dcp_world_size)
    except InvalidConfigError:
        return  # a configuration pagedkv does not cover yet: block-granular hits


def take_block_copies(core: Any, engine_pairs: list[list[tuple[Any, Any]]],
                      pool: BlockPoolView) -> tuple[list[Any], list[Any]]:
    """vLLM's ``take_kv_cache_block_copies``: the core's copy-on-write pairs
    (their retentions handed over as plain references, freed by the
    scheduler through the pool once the copy ran: D-MAMBA-19), then pairs an
    engine queued on a group view itself; ``(copies, retained blocks)``."""
    pairs, _ = core.take_kv_cache_block_copies(hand_over=True)
    blocks = pool.blocks
    endpoints = [(blocks[source], blocks[destination]) for source, destination in pairs]
    for queue in engine_pairs:
        endpoints.extend(queue)
        queue.clear()
    copies = [_compat.KVCacheBlockCopy(src_block_id=source.block_id, dst_block_id=destination.block_id)
              for source, destination in endpoints]
    return copies, [block for pair in endpoints for block in pair]


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
