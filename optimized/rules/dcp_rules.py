"""Decode context parallelism (DCP) beside Mamba groups, and the sub-block
hits of full-attention groups it brings (spec/mamba.md, "DCP and
full-attention sub-block hits", FPART-1..4, D-MAMBA-20..24).

Under DCP each rank stores ``1 / dcp`` of every attention block, so an
attention group's block spans ``dcp`` times its spec's tokens; a Mamba
group's state is replicated on every rank and keeps its own block size.
With the hash block as the hit granularity, a full-attention block then
spans several hash blocks, and a hit may end inside one: the request
shares that block's leading tokens and copies the block before writing on,
as a Mamba state is copied (MPART).

The optimized implementation's copy of the configuration rule, the prompt-tail boundary and the tail
choice; the reference states them again in ``pagedkv.reference.features``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.rules.mamba_checkpoint_rules import FINE_GRAINED_KINDS
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["context_parallel_block_size", "partial_hits_configured_under_dcp", "check_dcp_world_size",
           "prompt_tail_boundary", "tail_boundaries"]


def context_parallel_block_size(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """A group's block size in tokens under DCP: attention blocks are
    sharded over the ranks (``dcp`` times the spec's tokens); a Mamba state
    is replicated and keeps its own size (D-MAMBA-20)."""
    return spec.block_size if isinstance(spec, MambaSpec) else spec.block_size * dcp_world_size


def check_dcp_world_size(dcp_world_size: object) -> int:
    """``dcp_world_size`` as a positive int.

    Raises:
        InvalidConfigError: not a positive int.
    """
    if type(dcp_world_size) is not int or dcp_world_size < 1:
        raise InvalidConfigError(f"dcp_world_size must be a positive int, got {dcp_world_size!r}")
    return dcp_world_size


def partial_hits_configured_under_dcp(kinds: Sequence[str], specs: Sequence[KVCacheSpec],
                                      block_sizes: Sequence[int], hash_block_size: int,
                                      dcp_world_size: int) -> bool:
    """Whether vLLM 0.33 turns sub-block hits on (MCKPT-4 widened by DCP,
    D-MAMBA-20): two groups or more, a Mamba ``align`` group whose block is
    larger than the hash block -- or, under DCP (``dcp_world_size > 1``), at
    least the hash block, since the attention blocks DCP widened are the
    ones hit inside -- and every group able to look up at hash-block
    granularity. ``block_sizes`` are the effective sizes (DCP applied)."""
    if len(specs) < 2:
        return False
    least = hash_block_size if dcp_world_size > 1 else hash_block_size + 1
    if not any(isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align" and size >= least
               for spec, size in zip(specs, block_sizes)):
        return False
    # Groups outside prefix caching (rings, the opted-out scratch tails) never
    # look up, so they do not stand in the way (PFX-1), as in MCKPT-4.
    return all(kind in FINE_GRAINED_KINDS or size == hash_block_size or not prefix_cacheable(spec)
               for kind, size, spec in zip(kinds, block_sizes, specs))


def prompt_tail_boundary(num_prompt_tokens: int, num_block_hashes: int, hash_block_size: int,
                         use_eagle: bool = False) -> int:
    """The prompt boundary a full-attention group publishes inside a block
    (FPART-2): the last hash boundary a resend of the prompt can hit, which
    leaves at least one prompt token to compute, and no further than the
    request's hashes reach; 0 when there is none. An EAGLE group matches
    one hash block past its hit before giving it back (FPART-5), so its
    boundary may reach the whole prompt (D-MAMBA-39).

    pre: num_prompt_tokens >= 0 and num_block_hashes >= 0 and hash_block_size > 0
    post: __return__ % hash_block_size == 0
    post: __return__ <= num_block_hashes * hash_block_size
    post: __return__ <= num_prompt_tokens - (0 if use_eagle else 1) or __return__ == 0
    """
    reach = num_prompt_tokens if use_eagle else num_prompt_tokens - 1
    return max(0, min(reach // hash_block_size, num_block_hashes)) * hash_block_size


def tail_boundaries(length: int, max_length: int, num_hashed_tokens: int, hash_block_size: int,
                    block_size: int) -> range:
    """The boundaries whose partial key may serve the tail block of a hit of
    ``length`` tokens (FPART-1), best first: from the last hash boundary
    inside that block within ``max_length`` and the request's hashes, down
    to ``length`` itself. Empty when ``length`` is a block end."""
    if length % block_size == 0:
        return range(0)
    block_end = (length // block_size + 1) * block_size
    top = min(block_end - hash_block_size, max_length, num_hashed_tokens)
    top -= top % hash_block_size
    return range(top, length - 1, -hash_block_size)
