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

from pagedkv.optimized.engine import MambaManager as CoreMambaManager
from pagedkv.optimized.engine import publish_resume_state
from pagedkv.spec.errors import InvalidConfigError

from . import _compat
from .blocks import BlockPoolView
from .group_views import GroupManagerView
from .requests import VllmRequestView

__all__ = ["MambaManagerView", "CoreMambaManager", "enable_partial_hits_where_vllm_would",
           "take_block_copies"]


def enable_partial_hits_where_vllm_would(core: Any, dcp_world_size: int,
                                         shared_prefix_checkpoint: bool = False) -> bool:
    """Turn the core's sub-block hits on where vLLM 0.33 enables
    ``enable_partial_hash_hits`` and pagedkv supports them (D-MAMBA-14,
    D-MAMBA-15, D-MAMBA-21); elsewhere they stay off and the scheduler never
    splits chunks for them. The core's block sizes are already scaled for
    DCP; its size widens which Mamba groups qualify (D-MAMBA-20).

    ``shared_prefix_checkpoint`` (vLLM's ``enable_mamba_shared_prefix_checkpoint``)
    asks for the EAGLE resume checkpoint too; vLLM narrows it to models that
    draft, with sub-block hits and no re-prefilled tokens, and so does the
    core (D-MAMBA-40). Returns whether it is on."""
    if not core.enable_caching:
        return False
    if shared_prefix_checkpoint:
        try:
            core.enable_partial_hash_hits(dcp_world_size, shared_prefix_checkpoint=True)
            return True
        except InvalidConfigError:
            pass  # narrowed away: sub-block hits alone, where supported
    try:
        core.enable_partial_hash_hits(dcp_world_size)
    except InvalidConfigError:
        pass  # a configuration pagedkv does not cover yet: block-granular hits
    return False


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

    @property
    def shared_prefix_checkpoint(self) -> bool:
        """Whether the group publishes a request's observed junction (MPART-6)."""
        return bool(self.mamba_core.shared_prefix_checkpoint)

    def _cache_partial_tail_block(self, request: Any, num_tokens: int,
                                  retention_interval: int | None = None) -> Any:
        """vLLM's hook for the resume state a caching call ending at
        ``num_tokens`` leaves (the prompt tail, MPART-4/5, or the junction,
        MPART-6): runs the core's rule for this group and returns the key the
        group's state block took, ``None`` when the rule published nothing
        (e.g. a junction past the prompt: the running state is overwritten
        before a sibling could read it). ``retention_interval`` is the
        group's own; vLLM passes it for its signature."""
        core = self.mamba_core
        request_id = request.request_id
        if not core.sub_block_hits or request_id not in core.req_to_blocks:
            return None
        pool = core.block_pool
        before = {block: pool.key_tokens(block) for block in core.req_to_blocks[request_id] if block}
        caching_end, core.caching_end = core.caching_end, num_tokens
        try:
            publish_resume_state(core, VllmRequestView(request), request_id, num_tokens)
        finally:
            core.caching_end = caching_end
        for block in core.req_to_blocks[request_id]:
            if block and pool.key_tokens(block) == num_tokens and before.get(block) != num_tokens:
                return pool.block_hashes[block]
        return None
