"""Mamba prefill checkpoints: where a chunk's exported state lands (spec/mamba.md).

These are the contract with the worker, not a manager rule: the worker
exports a Mamba state at the position these functions name, into the block
at the column they name, and the manager must have reserved exactly that
block (MCKPT-1) or left the column null (MCKPT-2).

The reference's statement, written apart from ``pagedkv.optimized``'s: a
position is chosen by trying every aligned boundary, a mask block by block,
and each yes/no rule reads as the list of conditions the spec gives.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["checkpoint_position", "checkpoint_column", "checkpoint_exportable",
           "partial_hash_hits_configured", "FINE_GRAINED_KINDS", "mamba_kept_boundaries",
           "mamba_retention_mask", "checkpoint_published"]


def _aligned_at_most(limit: int, alignment: int) -> list[int]:
    """Every boundary (a multiple of ``alignment``, from 0) at or below ``limit``; ``[0]`` at least."""
    return [boundary for boundary in range(0, max(limit, 0) + 1, alignment)]


def checkpoint_position(num_tokens: int, alignment: int, drop_eagle_block: bool,
                        num_hash_lookahead_tokens: int = 0) -> int:
    """The last reusable state boundary in the first ``num_tokens`` (D-MAMBA-11), 0 if none.

    Boundaries are multiples of ``alignment`` (the cache-hit alignment).
    Without EAGLE the last one leaving at least one token to recompute the
    logits from and the hash lookahead's tokens to key it; with EAGLE the
    drafter re-reads one more unit, so one unit below the last boundary.
    """
    if drop_eagle_block:
        return max(max(_aligned_at_most(num_tokens, alignment)) - alignment, 0)
    tokens_left = max(1, num_hash_lookahead_tokens)
    return max(_aligned_at_most(num_tokens - tokens_left, alignment))


def checkpoint_column(query_end: int, block_size: int) -> int:
    """The block index the worker writes a chunk's checkpoint into (MCKPT-1):
    the one before the last block the first ``query_end`` tokens touch (that
    last block holds the running state)."""
    blocks_touched = len(range(0, query_end, block_size))
    running_state_column = blocks_touched - 1
    return running_state_column - 1


def checkpoint_exportable(*, query_start: int, query_end: int, position: int, hash_block_size: int,
                          block_size: int, export_alignment: int | None) -> bool:
    """Whether a backend can export the state at ``position`` while computing
    tokens ``[query_start, query_end)``: every condition below holds."""
    if export_alignment is None:
        return False  # the backend exports no checkpoint at all
    initial_state_column = (query_start - 1) // block_size
    conditions = (
        query_start % hash_block_size == 0,  # the chunk starts on a hash boundary
        query_start < position < query_end,  # strictly inside the chunk
        position - query_start >= hash_block_size,  # a hash block past its start
        (position - query_start) % export_alignment == 0,  # whole export steps from it
        checkpoint_column(query_end, block_size) > initial_state_column,  # past the initial state's block
    )
    return all(conditions)


FINE_GRAINED_KINDS = frozenset({"full_attention", "sink_full_attention", "rswa", "mamba"})
"""Manager kinds vLLM 0.33 lets look up hits at hash-block granularity."""


def partial_hash_hits_configured(kinds: Sequence[str], specs: Sequence[KVCacheSpec],
                                 block_sizes: Sequence[int], hash_block_size: int) -> bool:
    """Whether vLLM 0.33 turns sub-block (partial) hash hits on (MCKPT-4),
    condition by condition. One group alone never has them (vLLM's unitary
    coordinator keeps the scheduler's block alignment)."""
    if len(specs) < 2:
        return False
    groups = list(zip(kinds, specs, block_sizes))

    def spans_hash_blocks(spec: KVCacheSpec, size: int) -> bool:
        # A Mamba align state whose block holds more than one hash block.
        return isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align" and size > hash_block_size

    def looks_up_by_hash_block(kind: str, spec: KVCacheSpec, size: int) -> bool:
        # Groups outside prefix caching (rings) never look up (PFX-1).
        return kind in FINE_GRAINED_KINDS or size == hash_block_size or not prefix_cacheable(spec)

    return (any(spans_hash_blocks(spec, size) for _, spec, size in groups)
            and all(looks_up_by_hash_block(kind, spec, size) for kind, spec, size in groups))


def mamba_kept_boundaries(num_prompt_tokens: object, shared_prefix_boundary: object, alignment: int,
                          use_eagle: bool) -> tuple[int, ...]:
    """Token positions whose state sparse retention keeps in a Mamba group
    (MRET-1): where a replay of the prompt resumes, then the shared-prefix
    junction the engine pinned. An exact resend resumes one token short;
    with EAGLE one alignment unit below the last boundary of the resend
    (``P - 1`` tokens) and of a longer sibling (``P`` tokens), in order. A
    state has no window, so no block before or after is added."""
    kept: list[int] = []
    if type(num_prompt_tokens) is int and num_prompt_tokens > 0:
        if not use_eagle:
            kept.append(num_prompt_tokens - 1)
        else:
            replays = (num_prompt_tokens - 1, num_prompt_tokens)
            below = {max(max(_aligned_at_most(replay, alignment)) - alignment, 0) for replay in replays}
            kept.extend(sorted(below))
    if type(shared_prefix_boundary) is int and shared_prefix_boundary > 0:
        kept.append(shared_prefix_boundary)
    return tuple(kept)


def mamba_retention_mask(start_block: int, end_block: int, block_size: int, alignment: int,
                         retention_interval: int | None, boundaries: Sequence[int]) -> list[bool] | None:
    """Which of a Mamba group's blocks ``[start_block, end_block)`` keep their
    state in the prefix cache (MRET-1), block by block; ``None``: all of them.

    Block ``i`` holds the state after ``(i + 1) * block_size`` tokens. Dense
    retention (``None``) keeps all. With ``k > 0`` a segment is ``k //
    block_size`` blocks and the last block of each segment is kept (all when
    a segment is at most one block); ``0`` keeps none of those. Each
    boundary, floored to the alignment, also keeps the last block ending at
    or below it.

    pre: 0 <= start_block <= end_block and block_size >= 1 and alignment >= 1
    post: __return__ is None or len(__return__) == end_block - start_block
    """
    if retention_interval is None:
        return None
    blocks_per_segment = retention_interval // block_size if retention_interval > 0 else 0
    if retention_interval > 0 and blocks_per_segment <= 1:
        return None
    aligned = [boundary // alignment * alignment for boundary in boundaries]

    def kept(index: int) -> bool:
        block_end = (index + 1) * block_size
        ends_segment = blocks_per_segment > 0 and (index + 1) % blocks_per_segment == 0
        last_below_a_boundary = any(block_end <= point < block_end + block_size for point in aligned)
        return ends_segment or last_below_a_boundary

    return [kept(index) for index in range(start_block, end_block)]


def checkpoint_published(*, position: int, num_prompt_tokens: object, alignment: int, drop_eagle_block: bool,
                         num_hash_lookahead_tokens: int, block_size: int, retention_interval: int | None,
                         shared_prefix_boundary: object, partial_keys: bool) -> bool:
    """Whether a prefill checkpoint's state at ``position`` enters the prefix
    cache (MCKPT-5) rather than being overwritten by the next step
    (transient). It is published when it is any of: the prompt's own last
    reusable boundary, a block end that retention keeps (boundaries aside),
    or the shared-prefix junction. A position inside its block needs a
    partial key, so only with sub-block hits (``partial_keys``, D-MAMBA-26)."""
    at_block_end = position % block_size == 0
    if not at_block_end and not partial_keys:
        return False
    prompt_boundary = type(num_prompt_tokens) is int and position == checkpoint_position(
        num_prompt_tokens, alignment, drop_eagle_block, num_hash_lookahead_tokens)
    retained_block_end = False
    if at_block_end:
        index = position // block_size - 1
        mask = mamba_retention_mask(index, index + 1, block_size, alignment, retention_interval, ())
        retained_block_end = mask is None or mask[0]
    return prompt_boundary or retained_block_end or position == shared_prefix_boundary
