"""The decode fast path of ``allocate_slots``: the steps a coordinator installs
as :attr:`KVCacheCoordinator.decode_step`.

Split from :mod:`coordinator` (one concept per module): these functions read
the coordinator's tables and pool but change state only in the one case the
general path would change it the same way (a single full-attention group
filling or needing blocks). Whatever they do not settle returns
:data:`TAKE_GENERAL_PATH`, and the general path stays the definition.
``self`` names the coordinator, as in the methods these were.

What a step reads of the request, a contract ``pagedkv.vllm`` relies on
(D-PERF-11: it passes vLLM's own request unwrapped): ``request_id``,
``num_computed_tokens``, ``num_tokens`` and ``block_hashes``, and nothing
else unless the pool publishes kv-cache events (then the filling step takes
the request's facts for the events). Every read happens before the first
change.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, cast

from pagedkv.optimized.native import DECODE
from pagedkv.optimized.paths.decode import DecodeProbe, native_rules
from pagedkv.optimized.paths.recovery import recover
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.spec.request import RequestFacts, RequestView

if TYPE_CHECKING:
    from pagedkv.optimized.paths.coordinated import CoordinatorState

__all__ = ["TAKE_GENERAL_PATH", "DecodeStep", "single_decode_step", "probed_decode_step"]

TAKE_GENERAL_PATH = KVCacheBlocks((), [])
"""What :meth:`KVCacheCoordinator.decode_step` answers when it does not
settle a step itself: take the general path (the spec's steps), which
validates and raises. A distinct object compared by identity, never handed
out (an enum member costs a class-attribute lookup on the hottest path)."""

DecodeStep = Callable[[RequestView, int, bool], "KVCacheBlocks | None"]
"""``decode_step(request, num_new_tokens, delay_cache_blocks)``: the result,
or :data:`TAKE_GENERAL_PATH`."""


def single_decode_step(self: CoordinatorState) -> DecodeStep:
    """The decode step for one full-attention group hashed at its block
    size: a closure over the tables it reads (a cell load is cheaper
    than an attribute load, and this runs on most ``allocate_slots``
    calls). The step:

    ``step(request, num_new_tokens, delay_cache_blocks)`` is
    ``allocate_slots(request, num_new_tokens, delay_cache_blocks=...)``
    with no other argument (``num_new_tokens``: an int >= 1, checked by
    the caller). A known request whose new tokens fit the blocks it
    holds and fill no new block: nothing to do, O(1), no object
    created. A known request whose step fills a block or needs new ones
    (two decode steps in every block's worth at block size 16, and
    later prefill chunks): ``fill`` below. An unknown
    request, or anything the general path would reject (a malformed
    ``num_computed_tokens`` or ``num_tokens``, max_model_len exceeded,
    too few block hashes): :data:`TAKE_GENERAL_PATH`. ``num_tokens`` is
    read only from objects whose class is not in the coordinator's
    ``well_formed_request_types`` (pagedkv's own ``Request``, and any class an
    adapter vouches for, D-PERF-22), whose count is an int >= 1 by
    construction (a non-empty prompt, tokens only appended): the property
    call would cost the no-op step about a tenth of its time.

    The step carries ``inlinable``: ``(req_to_blocks, num_cached_blocks,
    block_size, max_model_len, enable_caching, fill)``, the tables its no-op
    branch reads and its filling branch ``fill(request, request_id, blocks,
    num_new_tokens, total, delay_cache_blocks)``, which it calls for a known
    request with an int ``num_computed_tokens`` (and a valid ``num_tokens``
    unless counted) when the no-op test fails, and which answers as the step
    but with the new blocks as their list of ids: an adapter may inline the
    step (D-PERF-33, D-PERF-34).

    Cost: O(1), or O(new blocks + blocks newly cached).
    """
    blocks_of = self._blocks0
    cached = self._cached0
    block_size = self._block_size0
    max_model_len = self.max_model_len
    caching = self.enable_caching
    empty = self.empty_blocks
    counted = self.well_formed_request_types  # the set itself: an adapter may add to it later
    coordinator = self
    pool = self.block_pool
    queue = pool._queue
    hashes = pool.block_hashes  # the pool's live list (cleared in place, never replaced)
    capture = RequestFacts.capture

    def step(request: RequestView, num_new_tokens: int,
             delay_cache_blocks: bool) -> KVCacheBlocks | None:
        try:
            request_id = request.request_id  # read once (the general path reads it once)
            # A subscript, not dict.get: no call on the hottest line.
            blocks = blocks_of[request_id]
        except (AttributeError, TypeError, KeyError):
            # Not a request, an unhashable id, or an unknown request: the
            # general path raises or admits it.
            return TAKE_GENERAL_PATH
        num_computed = request.num_computed_tokens
        if type(num_computed) is not int:
            return TAKE_GENERAL_PATH
        if request.__class__ not in counted:  # the general path's check 1b′
            num_tokens = request.num_tokens
            if type(num_tokens) is not int or num_tokens < 1:
                return TAKE_GENERAL_PATH
        total = num_computed + num_new_tokens
        # total >= num_new_tokens: a negative num_computed_tokens goes
        # to the general path, which raises.
        if num_new_tokens <= total <= len(blocks) * block_size and total <= max_model_len:
            # No new block. The blocks filled are min(total, num_tokens)
            # // b: none is new when total alone fills none, so
            # num_tokens (a property call) is left to the filling path.
            if (not caching or delay_cache_blocks
                    or total // block_size <= cached[request_id]):
                return empty
        new_blocks = fill(request, request_id, blocks, num_new_tokens, total, delay_cache_blocks)
        return KVCacheBlocks((new_blocks,), hashes) if isinstance(new_blocks, list) else new_blocks

    def fill(request: RequestView, request_id: str, blocks: list[int], num_new_tokens: int,
             total: int, delay_cache_blocks: bool) -> KVCacheBlocks | list[int] | None:
        # A step that fills a block or needs new ones: what the general
        # path does in that case, in the same order, minus the validation
        # and per-group dispatch that cannot apply: nothing to release
        # (full attention skips no token), refuse (None) when the free
        # queue is too short, append the missing blocks from the queue's
        # front, cache the blocks the step fills, return the new blocks: their
        # list, which the step wraps (an adapter calling fill itself translates
        # the list without the core's result object, D-PERF-34).
        # A closure like step (not a function taking the coordinator):
        # this runs about once per step per running request's block, cold
        # after the model's forward, where every frame and attribute chain
        # costs (D-PERF-31).
        if not num_new_tokens <= total <= max_model_len:
            return TAKE_GENERAL_PATH
        cache = caching and not delay_cache_blocks
        num_full = 0
        # Every read of the engine's object happens before the first change
        # (spec/operations.md, "Exception safety").
        num_tokens = request.num_tokens
        if type(num_tokens) is not int or num_tokens < 1:
            return TAKE_GENERAL_PATH  # which raises
        block_hashes = request.block_hashes
        if cache:
            num_full = (total if total < num_tokens else num_tokens) // block_size
            if num_full > len(block_hashes):
                return TAKE_GENERAL_PATH
            if pool.enable_kv_cache_events:
                request = capture(request)  # events read tokens and LoRA
        # The changes: an exception from here on leaves a consistent manager
        # (D-API-24).
        try:
            missing = -(-total // block_size) - len(blocks)
            new_blocks: list[int] | None = None
            if missing > 0:
                if missing > queue.size:  # get_num_free_blocks, without the call
                    return None
                new_blocks = pool.get_new_blocks(missing)
                blocks.extend(new_blocks)
            if cache:
                num_cached = cached[request_id]
                if num_cached < num_full:
                    # Unchecked: caching is on, the group exists, and num_full is
                    # bounded by the hashes (checked above) and by the blocks
                    # (total tokens fit them after the allocation).
                    pool.cache_full_blocks_unchecked(
                        request, blocks, block_hashes=block_hashes,
                        num_cached_blocks=num_cached, num_full_blocks=num_full,
                        block_size=block_size, group_id=0, mask=None)
                    cached[request_id] = num_full
            return empty if new_blocks is None else new_blocks
        except BaseException:
            recover(coordinator)
            raise

    # What the no-op branch reads, in this order, and the filling branch, for an
    # adapter that inlines the step in its own allocate_slots (one frame fewer on
    # the engine's commonest call, D-PERF-33): answers equal to this step's, as
    # long as the coordinator's decode_step is this step.
    step.inlinable = (blocks_of, cached, block_size, max_model_len, caching, fill)  # type: ignore[attr-defined]
    return step

def probed_decode_step(self: CoordinatorState, probes: tuple[DecodeProbe, ...],
                       fill: DecodeStep | None = None) -> DecodeStep:
    """The decode step for every other covered configuration (a closure,
    as :func:`single_decode_step`; in a native build the C step
    ``_decode.decode_step`` bound to it, which answers the no-op case and
    hands it the rest, D-PERF-50), decided per group by
    :func:`decode.is_noop_decode`: the empty result when no group needs
    a block, fills one or releases one; else ``fill(request,
    num_new_tokens, delay_cache_blocks)`` (``fill_path``, D-PERF-37) when
    given, or :data:`TAKE_GENERAL_PATH`. Cost: O(groups), or the fill's."""
    general = TAKE_GENERAL_PATH
    # The no-op test in C when built (D-PERF-39): True, False, or None for
    # what it does not cover (then the loop below answers).
    rules = None if DECODE is None else native_rules(self.managers, probes)
    noop = None if DECODE is None else DECODE.noop
    max_model_len = self.max_model_len
    caching = self.enable_caching
    hash_block_size = self.hash_block_size
    empty = self.empty_blocks
    counted = self.well_formed_request_types  # Request and the manager's own subclass (D-PERF-35)

    def step(request: RequestView, num_new_tokens: int,
             delay_cache_blocks: bool) -> KVCacheBlocks | None:
        caches = caching and not delay_cache_blocks
        num_tokens = 1
        try:
            num_computed = request.num_computed_tokens
            # num_tokens: read where the step needs it (caching), or for the
            # general path's check 1b′ on classes not in well_formed_request_types
            # (pagedkv's own Request classes and any an adapter vouches for: an
            # int >= 1 by construction, as in the single step, D-PERF-22).
            if caches or request.__class__ not in counted:
                num_tokens = request.num_tokens
        except AttributeError:
            return TAKE_GENERAL_PATH  # not a request: the general path raises
        if type(num_computed) is not int or type(num_tokens) is not int or num_tokens < 1:
            return TAKE_GENERAL_PATH
        total = num_computed + num_new_tokens
        if not num_new_tokens <= total <= max_model_len:
            return TAKE_GENERAL_PATH
        cache_tokens = -1  # the step caches nothing
        if caches:
            cache_tokens = total if total < num_tokens else num_tokens
        try:
            # Hashes falling short of the blocks to cache: the general path raises.
            if cache_tokens // hash_block_size > len(request.block_hashes):
                return TAKE_GENERAL_PATH
            request_id = request.request_id
            if rules is not None and noop is not None:
                verdict = noop(rules, request_id, num_computed, total, cache_tokens)
                if verdict is True:
                    return empty
                if verdict is False:
                    return general if fill is None else fill(request, num_new_tokens, delay_cache_blocks)
            # decode.is_noop_decode, line for line, inlined: a call (a frame)
            # per step cost the no-op step more than the robustness checks
            # above. test_multi_group_decode_fast_path_is_exactly_a_no_op
            # holds the two to the same answer.
            for blocks_of, cached_of, block_size, extra, cache_size, released, align in probes:
                try:
                    blocks = blocks_of[request_id]
                except KeyError:
                    return TAKE_GENERAL_PATH
                held = len(blocks)
                if total + extra > held * block_size:
                    break
                if cache_tokens // cache_size > cached_of[request_id]:
                    break
                if released is not None:
                    skipped = released(num_computed)
                    if skipped >= block_size:
                        index = skipped // block_size
                        if blocks[(index if index < held else held) - 1]:
                            break
                    if align is not None:
                        last = align.get(request_id)
                        if last is not None and last < -(-(skipped + 1) // block_size) - 1 and (
                                last >= held or blocks[last]):
                            break
            else:
                return empty
        except TypeError:
            return TAKE_GENERAL_PATH  # an unhashable id: the general path raises
        # Some group has work: the filling step (which checks the request is
        # known in every group) or the general path.
        return general if fill is None else fill(request, num_new_tokens, delay_cache_blocks)

    if DECODE is None or rules is None:
        return step
    # The no-op case in C, everything else handed to step (D-PERF-50); the
    # context's order is _decode.c's STEP_ enumeration.
    context = (step, rules, counted, max_model_len, bool(caching), hash_block_size, empty)
    return cast("DecodeStep", partial(DECODE.decode_step, context))

# ------------------------------------------------------------- the steps
