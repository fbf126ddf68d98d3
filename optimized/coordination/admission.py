"""Full-sequence admission (spec/managers.md §8, D-CAP-1).

``allocate_slots(..., full_sequence_must_fit=True)`` also requires the whole
request to fit, each group counted at its admission requirement: windowed
groups (sliding window, chunked local) at most at the cap startup sizing
used, Mamba at its running state plus draft states, cross-attention by its
encoder tokens. An engine that admits by that rule then agrees with the
pool size the planner chose.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.cross_attention import CrossAttentionManager
from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.ring import RingManager
from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec

__all__ = ["admission_caps", "full_sequence_demand"]


def admission_caps(managers: Sequence[SingleTypeManager], max_num_batched_tokens: int,
                   max_model_len: int) -> list[int | None]:
    """Per group, the windowed spec's per-request cap (CFG-7, CFG-8; what
    SWA-1 and CHUNK-1 bound), else None."""
    caps: list[int | None] = []
    for manager in managers:
        spec = manager.kv_cache_spec
        caps.append(spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
                    if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) else None)
    return caps


def full_sequence_demand(managers: Sequence[SingleTypeManager], caps: Sequence[int | None], request_id: str,
                         num_tokens: int, hits: Sequence[Sequence[int]] | None, num_encoder_tokens: int,
                         ref_counts: Sequence[int]) -> int:
    """Free blocks a request of ``num_tokens`` tokens needs beyond the real
    blocks it holds (known) or takes from its hit (new), plus hit blocks that
    would leave the free queue.

    Cost: O(groups + blocks held or hit).
    """
    demand = 0
    for group_id, (manager, cap) in enumerate(zip(managers, caps)):
        block_size = manager.block_size
        if isinstance(manager, MambaManager):
            required = 1 + manager.num_speculative_blocks
        elif isinstance(manager, CrossAttentionManager):
            required = -(-num_encoder_tokens // block_size)
        elif isinstance(manager, RingManager):
            required = 1  # one ring block, whatever the length (RING-1)
        else:
            required = -(-num_tokens // block_size)
            if cap is not None and isinstance(manager, (SlidingWindowManager, ChunkedLocalAttentionManager)):
                required = min(required, cap)
        held = manager.req_to_blocks.get(request_id)
        group_hits: Sequence[int] = hits[group_id] if hits is not None else ()
        blocks = group_hits if held is None else held
        covered = sum(1 for block in blocks if block)
        if required > covered:
            demand += required - covered
        if held is None:
            demand += sum(1 for block in group_hits if block and ref_counts[block] == 0)
    return demand
