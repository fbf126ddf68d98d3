"""The rules of decode context parallelism (DCP) that the reference
states itself (spec/mamba.md, "DCP and full-attention sub-block hits":
FPART-1..4, D-MAMBA-20..24).

What changes under DCP: every rank keeps a ``1 / dcp`` share of each
attention block, so one attention block covers ``dcp`` times the tokens its
spec names, while a Mamba state, the same on every rank, keeps its size.
Hits are found hash block by hash block, and a widened full-attention
block now holds several of them, so a hit can stop part-way into a block.
The request then shares that block's first tokens and writes on a copy of
it, the way a Mamba state is copied (MPART).

Here each boundary rule tries every candidate boundary and keeps the ones
that qualify; ``pagedkv.optimized`` computes the same answers in closed
form, and the lockstep machines compare the two.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference.features.mamba_checkpoint_rules import FINE_GRAINED_KINDS
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["context_parallel_block_size", "partial_hits_configured_under_dcp", "check_dcp_world_size",
           "prompt_tail_boundary", "tail_boundaries"]


def context_parallel_block_size(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """A group's block in tokens under DCP (D-MAMBA-20): a Mamba state is
    the same on every rank; an attention block holds ``dcp_world_size``
    times its spec's tokens, a share on each rank."""
    if isinstance(spec, MambaSpec):
        return spec.block_size
    return dcp_world_size * spec.block_size


def check_dcp_world_size(dcp_world_size: object) -> int:
    """Return ``dcp_world_size`` if it is a whole number of ranks (an int >= 1).

    Raises:
        InvalidConfigError: otherwise.
    """
    if type(dcp_world_size) is int and dcp_world_size >= 1:
        return dcp_world_size
    raise InvalidConfigError(f"dcp_world_size must be a positive int, got {dcp_world_size!r}")


def partial_hits_configured_under_dcp(kinds: Sequence[str], specs: Sequence[KVCacheSpec],
                                      block_sizes: Sequence[int], hash_block_size: int,
                                      dcp_world_size: int) -> bool:
    """Whether vLLM 0.33 turns sub-block hits on (MCKPT-4 as DCP widens it,
    D-MAMBA-20), condition by condition; ``block_sizes`` have DCP applied."""
    if len(specs) < 2:
        return False  # one group: nothing to reconcile

    def hit_inside(spec: KVCacheSpec, size: int) -> bool:
        # A Mamba align state spanning several hash blocks; under DCP, whose
        # widened attention blocks are the ones hit inside, one hash block suffices.
        return isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align" and (
            size > hash_block_size or (dcp_world_size > 1 and size == hash_block_size))

    def looks_up_by_hash_block(kind: str, spec: KVCacheSpec, size: int) -> bool:
        # Groups outside prefix caching never look up (PFX-1).
        return kind in FINE_GRAINED_KINDS or size == hash_block_size or not prefix_cacheable(spec)

    groups = list(zip(kinds, specs, block_sizes))
    return (any(hit_inside(spec, size) for _, spec, size in groups)
            and all(looks_up_by_hash_block(kind, spec, size) for kind, spec, size in groups))


def prompt_tail_boundary(num_prompt_tokens: int, num_block_hashes: int, hash_block_size: int,
                         use_eagle: bool = False) -> int:
    """FPART-2's boundary, by trying every hash boundary the request's hashes
    reach: the last one a resend of the prompt can hit, which leaves a
    prompt token to compute (an EAGLE group, matching one hash block past
    its hit, may reach the whole prompt: FPART-5, D-MAMBA-39); 0 if none.

    pre: num_prompt_tokens >= 0 and num_block_hashes >= 0 and hash_block_size > 0
    post: __return__ % hash_block_size == 0
    post: __return__ <= num_block_hashes * hash_block_size
    post: __return__ <= num_prompt_tokens - (0 if use_eagle else 1) or __return__ == 0
    """
    last_hittable = num_prompt_tokens if use_eagle else num_prompt_tokens - 1
    boundaries = [count * hash_block_size for count in range(num_block_hashes + 1)]
    return max((boundary for boundary in boundaries if boundary <= last_hittable), default=0)


def tail_boundaries(length: int, max_length: int, num_hashed_tokens: int, hash_block_size: int,
                    block_size: int) -> list[int]:
    """FPART-1, by listing: the hash boundaries at or past ``length`` inside
    the block that holds a hit of ``length`` tokens, within ``max_length``
    and the hashed tokens, best (furthest) first; none when ``length`` ends
    a block."""
    if length % block_size == 0:
        return []
    block_end = (length // block_size + 1) * block_size
    inside = [boundary for boundary in range(length, block_end)
              if boundary % hash_block_size == 0 and boundary <= max_length and boundary <= num_hashed_tokens]
    return sorted(inside, reverse=True)
