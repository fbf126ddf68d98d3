"""The decode test of the coordinator's fast path for several KV cache groups.

Most ``allocate_slots`` calls are decode steps of a known request: one more
token, no prefix hit, no lookahead, external or encoder tokens. In most of
them no group needs a new block, no group has a block to release (its
window has not moved past a block boundary) and no block fills, so the
general path (validate, ``remove_skipped_blocks``, count, allocate and cache
in every group) changes nothing and returns the empty result. This module
decides that case directly from each group's block list and cached count,
in one pass over the groups. Any other step takes the general path, which
stays the definition. The skip rule itself is not restated here: each
group's ``released_tokens`` is called.

Worked example (sliding window 8, block size 4, one full-attention group
beside it): a request holding ``[N, b1, b2]`` in the window group and
``[f0, f1, f2]`` in the full group, 10 tokens computed, cached 2 blocks per
group, asks for 1 more token. Total 11 fits the 12 slots of both lists;
``min(11, num_tokens) // 4 = 2`` blocks are full, already cached; the
window skips ``10 - 8 + 1 = 3`` tokens, less than a block, nothing to
release: a no-op. At 13 computed tokens the window skips 6 tokens and
block 0 lies behind it, already null: a no-op; at 16 it skips 9 and block
1 (``b1``) lies behind it: the general path releases it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.ring import RingManager
from pagedkv.optimized.groups.single_type import FullAttentionManager, SingleTypeManager, SinkFullAttentionManager
from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager

__all__ = ["DecodeProbe", "decode_probes", "is_noop_decode", "native_rules"]

_NEVER = 1 << 62
"""Cache block size of a group that never caches (Mamba ``none``): no token
count fills one of its blocks."""

DecodeProbe = tuple[dict[str, list[int]], dict[str, int], int, int, int,
                    Callable[[int], int] | None, dict[str, int] | None]
"""Per group: its ``req_to_blocks`` and ``num_cached_blocks`` (live), block
size, extra slots a step needs beyond its tokens (Mamba speculative blocks),
the block size caching counts in (``_NEVER``: none), and its
``released_tokens`` (``None`` for types that release nothing), and for
Mamba ``align`` its live ``last_state_block`` (``None`` otherwise)."""


def decode_probes(managers: Sequence[SingleTypeManager]) -> tuple[DecodeProbe, ...] | None:
    """The probes of :func:`is_noop_decode` for these managers, or ``None``
    when some group's type is not covered (cross-attention, Mamba
    ``align``, any other class): such configurations always take the
    general path. Exact classes are matched, so a subclass with other rules
    is never probed by its parent's. Cost: O(groups).
    """
    probes: list[DecodeProbe] = []
    for manager in managers:
        kind = type(manager)
        block_size = manager.block_size
        extra = 0
        cache_size = block_size
        released: Callable[[int], int] | None = manager.released_tokens
        align: dict[str, int] | None = None
        if kind is FullAttentionManager or kind is SinkFullAttentionManager:
            released = None
        elif kind is RingManager:
            # One block for the whole request (RING-1): a held ring never
            # needs another slot, caches nothing and releases nothing.
            block_size = cache_size = _NEVER
            released = None
        elif kind is SlidingWindowManager or kind is ChunkedLocalAttentionManager:
            # Their released_tokens is skipped_tokens itself: one call fewer.
            released = manager.skipped_tokens
        elif kind is MambaManager:
            assert isinstance(manager, MambaManager)
            extra = block_size * manager.num_speculative_blocks
            if manager.has_checkpoints:
                return None  # every step records or forgets a prefill checkpoint (spec/mamba.md)
            if manager.mode == "align":
                # A step that needs no block allocates none in align mode
                # either; what align adds is the release of last step's
                # state block once copied, probed in is_noop_decode.
                align = manager.last_state_block
            if manager.mode == "none":
                cache_size = _NEVER
        else:
            return None
        probes.append((manager.req_to_blocks, manager.num_cached_blocks, block_size, extra,
                       cache_size, released, align))
    return tuple(probes)


def is_noop_decode(probes: tuple[DecodeProbe, ...], request_id: str, num_computed: int,
                   total: int, cache_tokens: int) -> bool:
    """Whether a step taking a request from ``num_computed`` to ``total``
    tokens (no hit, lookahead, external or encoder tokens)
    changes nothing in any group: every group holds slots for ``total``
    tokens (plus its extra slots), caches no new block
    (``cache_tokens``: ``min(total, num_tokens)``, or ``-1`` when the step
    caches nothing) and releases no block (the block just behind the
    released tokens is already null, or there is none). ``False`` for an
    unknown request. The caller checks the arguments' bounds.

    Cost: O(groups), a few list and dict loads per group.
    """
    for blocks_of, cached_of, block_size, extra, cache_size, released, align in probes:
        try:
            blocks = blocks_of[request_id]  # a subscript, not dict.get: no call per group
        except KeyError:
            return False
        held = len(blocks)
        if total + extra > held * block_size:
            return False  # a new block: the general path allocates
        if cache_tokens // cache_size > cached_of[request_id]:
            return False  # a block filled: the general path caches it
        if released is not None:
            # remove_skipped_blocks: the block just behind the released
            # tokens must already be null (held >= 1 here).
            skipped = released(num_computed)
            if skipped >= block_size:
                index = skipped // block_size
                if blocks[(index if index < held else held) - 1]:
                    return False
            if align is not None:
                # MambaManager.remove_skipped_blocks in align mode releases
                # last step's state block once the state has moved past it;
                # the count it compares with is the released tokens + 1 (a
                # Mamba group keeps only the state after the last token), so
                # the probe follows whatever count released_tokens settles on.
                last = align.get(request_id)
                if last is not None and last < -(-(skipped + 1) // block_size) - 1 and (
                        last >= held or blocks[last]):
                    return False
    return True


def native_rules(managers: Sequence[SingleTypeManager],
                 probes: tuple[DecodeProbe, ...]) -> tuple[tuple[object, ...], ...] | None:
    """The probes as ``optimized/_decode.c`` reads them (D-PERF-39): each
    group's skip rule as data, ``(kind, parameter)``, instead of its bound
    method: 0 none, 1 a sliding window of ``retained`` tokens
    (:meth:`SlidingWindowManager.skipped_tokens`), 2 chunks
    (:meth:`ChunkedLocalAttentionManager.skipped_tokens`), 3 a Mamba state
    (``num_computed - 1``). ``None`` when a group's rule is none of those.
    Cost: O(groups)."""
    rules: list[tuple[object, ...]] = []
    for manager, (blocks_of, cached_of, block_size, extra, cache_size, released, align) in zip(managers, probes):
        kind = type(manager)
        skip, param = 0, 0
        if released is None:
            pass
        elif kind is SlidingWindowManager:
            assert isinstance(manager, SlidingWindowManager)
            skip, param = 1, manager.retained
        elif kind is ChunkedLocalAttentionManager:
            assert isinstance(manager, ChunkedLocalAttentionManager)
            skip, param = 2, manager.chunk_size
        elif kind is MambaManager:
            skip = 3
        else:
            return None
        rules.append((blocks_of, cached_of, block_size, extra, cache_size, skip, param, align))
    return tuple(rules)
