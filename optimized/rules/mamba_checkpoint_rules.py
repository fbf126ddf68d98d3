"""Mamba prefill checkpoints: where a chunk's exported state lands (spec/mamba.md).

These are the contract with the worker, not a manager rule: the worker
exports a Mamba state at the position these functions name, into the block
at the column they name, and the manager must have reserved exactly that
block (MCKPT-1) or left the column null (MCKPT-2). The optimized implementation's copy;
the reference states them again in ``pagedkv.reference.features``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["checkpoint_position", "checkpoint_column", "checkpoint_exportable",
           "partial_hash_hits_configured", "FINE_GRAINED_KINDS", "mamba_kept_boundaries",
           "mamba_retention_mask", "checkpoint_published"]


def checkpoint_position(num_tokens: int, alignment: int, drop_eagle_block: bool,
                        num_hash_lookahead_tokens: int = 0) -> int:
    """The last reusable state boundary strictly inside the first ``num_tokens``.

    A boundary is a multiple of ``alignment`` (the cache-hit alignment). It
    must leave at least one token to recompute the logits from, and as many
    as the hash lookahead needs to key it; with EAGLE the drafter re-reads
    one more alignment unit, so the boundary moves one unit down (D-MAMBA-11).
    """
    if drop_eagle_block:
        return max(num_tokens // alignment * alignment - alignment, 0)
    limit = num_tokens - max(1, num_hash_lookahead_tokens)
    return max(limit // alignment * alignment, 0)


def checkpoint_column(query_end: int, block_size: int) -> int:
    """The block index the worker writes a chunk's checkpoint into: the one
    just before the block holding the running state at ``query_end``."""
    return -(-query_end // block_size) - 2


def checkpoint_exportable(*, query_start: int, query_end: int, position: int, hash_block_size: int,
                          block_size: int, export_alignment: int | None) -> bool:
    """Whether a backend can export the state at ``position`` while computing
    tokens ``[query_start, query_end)``.

    It can when the chunk starts on a hash boundary, the position lies
    strictly inside the chunk at least one hash block past its start and a
    whole number of ``export_alignment`` steps from it, and the target column
    lies past the block holding the chunk's initial state.
    """
    if export_alignment is None:
        return False
    initial_column = (query_start - 1) // block_size
    return (query_start % hash_block_size == 0
            and checkpoint_column(query_end, block_size) > initial_column
            and query_start + hash_block_size <= position
            and query_start < position < query_end
            and (position - query_start) % export_alignment == 0)


FINE_GRAINED_KINDS = frozenset({"full_attention", "sink_full_attention", "rswa", "mamba"})
"""Manager kinds vLLM 0.33 lets look up hits at hash-block granularity."""


def partial_hash_hits_configured(kinds: Sequence[str], specs: Sequence[KVCacheSpec],
                                 block_sizes: Sequence[int], hash_block_size: int) -> bool:
    """Whether vLLM 0.33 would turn on sub-block (partial) hash hits here
    (MCKPT-4): a Mamba ``align`` group whose block is larger than a hash
    block, and every other group able to look up at hash-block granularity
    (a kind in ``FINE_GRAINED_KINDS`` or a block of one hash block). One
    group alone never has them (vLLM's unitary coordinator keeps the
    scheduler's block alignment)."""
    if len(specs) < 2:
        return False
    if not any(isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align" and size > hash_block_size
               for spec, size in zip(specs, block_sizes)):
        return False
    # Groups outside prefix caching (rings) never look up (PFX-1).
    return all(kind in FINE_GRAINED_KINDS or size == hash_block_size or not prefix_cacheable(spec)
               for kind, size, spec in zip(kinds, block_sizes, specs))


def mamba_kept_boundaries(num_prompt_tokens: object, shared_prefix_boundary: object, alignment: int,
                          use_eagle: bool) -> tuple[int, ...]:
    """Token positions whose state sparse retention keeps in a Mamba group
    (MRET-1): where a replay of the prompt resumes (an exact resend stops
    one token short; with EAGLE one alignment unit below the resend's and a
    longer sibling's aligned ends) and the shared-prefix junction the engine
    pinned. A state has no window, so no block before or after is added."""
    kept: list[int] = []
    if type(num_prompt_tokens) is int and num_prompt_tokens >= 1:
        if use_eagle:
            resend = (num_prompt_tokens - 1) // alignment * alignment
            extension = num_prompt_tokens // alignment * alignment
            kept.extend(sorted({max(resend - alignment, 0), max(extension - alignment, 0)}))
        else:
            kept.append(num_prompt_tokens - 1)
    if type(shared_prefix_boundary) is int and shared_prefix_boundary > 0:
        kept.append(shared_prefix_boundary)
    return tuple(kept)


def mamba_retention_mask(start_block: int, end_block: int, block_size: int, alignment: int,
                         retention_interval: int | None, boundaries: Sequence[int]) -> list[bool] | None:
    """Which of a Mamba group's blocks ``[start_block, end_block)`` keep their
    state in the prefix cache (MRET-1); ``None``: all of them.

    Block ``i`` holds the state after ``(i + 1) * block_size`` tokens. Dense
    retention (``None``) keeps all; ``k > 0`` keeps the blocks ending on a
    multiple of ``k`` (all when ``k`` spans at most one block); ``0`` none of
    those. Under sparse retention the block ending just below each boundary,
    floored to the alignment, is kept as well.

    pre: 0 <= start_block <= end_block and block_size >= 1 and alignment >= 1
    post: __return__ is None or len(__return__) == end_block - start_block
    """
    if retention_interval is None:
        return None
    mask = [False] * len(range(start_block, end_block))
    if retention_interval > 0:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        for index in range(start_block, end_block):
            if (index + 1) % per_segment == 0:
                mask[index - start_block] = True
    for boundary in boundaries:
        index = boundary // alignment * alignment // block_size - 1
        if start_block <= index < end_block:
            mask[index - start_block] = True
    return mask


def checkpoint_published(*, position: int, num_prompt_tokens: object, alignment: int, drop_eagle_block: bool,
                         num_hash_lookahead_tokens: int, block_size: int, retention_interval: int | None,
                         shared_prefix_boundary: object, partial_keys: bool) -> bool:
    """Whether a prefill checkpoint's state at ``position`` enters the prefix
    cache (MCKPT-5): it is the prompt's own last reusable boundary, or a block
    end that retention keeps (boundaries aside), or the shared-prefix
    junction. Otherwise the next step overwrites it: it is transient. A
    position inside its block needs a partial key, so sub-block hits
    (``partial_keys``) must be on for it to be of use (D-MAMBA-26)."""
    if position % block_size and not partial_keys:
        return False
    if type(num_prompt_tokens) is int and position == checkpoint_position(
            num_prompt_tokens, alignment, drop_eagle_block, num_hash_lookahead_tokens):
        return True
    if position % block_size == 0:
        index = position // block_size - 1
        kept = mamba_retention_mask(index, index + 1, block_size, alignment, retention_interval, ())
        if kept is None or kept[0]:
            return True
    return position == shared_prefix_boundary
