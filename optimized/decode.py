"""The decode fast path for several KV cache groups.

Most ``allocate_slots`` calls are decode steps of a known request: one more
token, no prefix hit, no lookahead, external or encoder tokens. In most of
them no group needs a new block, no group has a block to release (its
window has not moved past a block boundary) and no block fills, so the
general path (validate, ``remove_skipped_blocks``, count, allocate and cache
in every group) changes nothing and returns the empty result. This module
decides that case directly from each group's block list and cached count,
in one pass over the groups with no call per group. Any other step takes
the general path, which stays the definition.

Worked example (sliding window 8, block size 4, one full-attention group
beside it): a request holding ``[N, b1, b2]`` in the window group and
``[f0, f1, f2]`` in the full group, 10 tokens computed, cached 2 blocks per
group, asks for 1 more token. Total 11 fits the 12 slots of both lists;
``min(11, num_tokens) // 4 = 2`` blocks are full, already cached; the
window skips ``10 - 8 + 1 = 3`` tokens, less than a block, nothing to
release: a no-op. At 13 computed tokens the window skips 6 tokens and
block 0 lies behind it, already null: a no-op; at 16 it skips 9 and block
1 (``b1``) lies behind it: the general path releases it.

:func:`allocate_known_single` takes the steps the facade's O(1) fast path
leaves over with one full-attention group: a known request whose step fills
a block or needs new ones (two decode steps in every block's worth at block
size 16, and later prefill chunks). It does what the general path does for
such a step, minus the validation and per-group dispatch that cannot apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.spec.request import RequestView

from .blocks import KVCacheBlocks
from .mamba import MambaManager
from .single_type import FullAttentionManager, GroupManager, SinkFullAttentionManager
from .windowed import ChunkedLocalAttentionManager, SlidingWindowManager

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["DecodeProbe", "decode_probes", "is_noop_decode", "allocate_known_single"]

# How a group's ``skipped_tokens`` is computed (``remove_skipped_blocks``).
_NO_SKIP = 0
_SLIDING = 1
_CHUNKED = 2
_MAMBA = 3

_NEVER = 1 << 62
"""Cache block size of a group that never caches (Mamba ``none``): no token
count fills one of its blocks."""

DecodeProbe = tuple[dict[str, list[int]], dict[str, int], int, int, int, int, int]
"""Per group: its ``req_to_blocks`` and ``cached_count`` (live), block size,
extra slots a step needs beyond its tokens (Mamba speculative blocks), the
block size caching counts in (``_NEVER``: none), the skip kind and its
parameter (window, chunk, speculative blocks)."""


def decode_probes(managers: Sequence[GroupManager]) -> tuple[DecodeProbe, ...] | None:
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
        if kind is FullAttentionManager or kind is SinkFullAttentionManager:
            skip, param = _NO_SKIP, 0
        elif kind is SlidingWindowManager:
            assert isinstance(manager, SlidingWindowManager)
            skip, param = _SLIDING, manager.window
        elif kind is ChunkedLocalAttentionManager:
            assert isinstance(manager, ChunkedLocalAttentionManager)
            skip, param = _CHUNKED, manager.chunk_size
        elif kind is MambaManager:
            assert isinstance(manager, MambaManager)
            if manager.mode == "align":
                return None
            skip, param = _MAMBA, manager.num_speculative_blocks
            extra = block_size * manager.num_speculative_blocks
            if manager.mode == "none":
                cache_size = _NEVER
        else:
            return None
        probes.append((manager.req_to_blocks, manager.cached_count, block_size, extra,
                       cache_size, skip, param))
    return tuple(probes)


def is_noop_decode(probes: tuple[DecodeProbe, ...], request_id: str, num_computed: int,
                   total: int, cache_tokens: int) -> bool:
    """Whether a step taking a request from ``num_computed`` to ``total``
    tokens (no hit, lookahead, external or encoder tokens)
    changes nothing in any group: every group holds slots for ``total``
    tokens (plus its extra slots), caches no new block
    (``cache_tokens``: ``min(total, num_tokens)``, or ``-1`` when the step
    caches nothing) and releases no block (the block just behind the
    skipped tokens is already null, or there is none). ``False`` for an
    unknown request. The caller checks the arguments' bounds.

    Cost: O(groups), a few list and dict loads per group.
    """
    for blocks_of, cached_of, block_size, extra, cache_size, skip, param in probes:
        blocks = blocks_of.get(request_id)
        if blocks is None:
            return False
        held = len(blocks)
        if total + extra > held * block_size:
            return False  # a new block: the general path allocates
        if cache_tokens // cache_size > cached_of[request_id]:
            return False  # a block filled: the general path caches it
        if skip:
            # remove_skipped_blocks: the skipped tokens, then the block
            # just behind them must already be null (held >= 1 here).
            if skip == _SLIDING:
                skipped = num_computed - param + 1
            elif skip == _CHUNKED:
                skipped = num_computed // param * param
            else:
                skipped = (num_computed - param if num_computed > param else 0) - 1
            if skipped >= block_size:
                index = skipped // block_size
                if blocks[(index if index < held else held) - 1]:
                    return False
    return True


def allocate_known_single(manager: KVCacheManager, request: RequestView, blocks: list[int],
                          num_new_tokens: int, delay_cache_blocks: bool) -> KVCacheBlocks | None:
    """``manager.allocate_slots(request, num_new_tokens, delay_cache_blocks=...)``
    with no other argument, for a manager of one full-attention group hashed
    at its block size and a known request holding ``blocks``
    (``num_new_tokens``: an int >= 1, checked by the caller).

    What the general path does in that case, in the same order: nothing to
    release (full attention skips no token), refuse (``None``) when the
    free queue holds fewer blocks than are missing, append the missing
    blocks from the free queue's front (evicting keys they carry, with
    ``BlockRemoved``), cache the blocks the step fills (``BlockStored``),
    return the new blocks. Anything the general path would reject (a
    malformed ``num_computed_tokens``, max_model_len exceeded, too few
    block hashes) is handed to it, and it raises.

    Cost: O(new blocks + blocks newly cached), no per-group dispatch.
    """
    num_computed = request.num_computed_tokens
    total = num_computed + num_new_tokens
    if type(num_computed) is not int or num_computed < 0 or total > manager.max_model_len:
        return manager._allocate_slots(request, num_new_tokens, 0, None, 0, 0,
                                       delay_cache_blocks, 0)
    block_size = manager._block_size0
    cache = manager.enable_caching and not delay_cache_blocks
    num_full = 0
    if cache:
        num_tokens = request.num_tokens
        num_full = (total if total < num_tokens else num_tokens) // block_size
        if num_full > len(request.block_hashes):
            return manager._allocate_slots(request, num_new_tokens, 0, None, 0, 0,
                                           delay_cache_blocks, 0)
    pool = manager._pool
    missing = -(-total // block_size) - len(blocks)
    new_blocks: list[int] | None = None
    if missing > 0:
        if missing > pool._queue.size:  # the free queue's length, no call
            return None
        new_blocks = pool.get_new_blocks(missing)
        blocks.extend(new_blocks)
    if cache:
        cached_count = manager._single_cached
        request_id = request.request_id
        num_cached = cached_count[request_id]
        if num_cached < num_full:
            # Unchecked: caching is on, group 0 exists, and num_full is
            # bounded by the hashes (checked above) and by the blocks (total
            # tokens fit them after the allocation).
            pool._cache_full_blocks(request, blocks, num_cached, num_full, block_size, 0,
                                    request.block_hashes, None)
            cached_count[request_id] = num_full
    if new_blocks is None:
        return manager._empty
    return KVCacheBlocks((new_blocks,), pool.block_hashes)
