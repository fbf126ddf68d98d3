"""The decode fast path of ``allocate_slots``: the steps a coordinator installs
as :attr:`KVCacheCoordinator.decode_step`.

One decision function for every covered configuration (one full-attention
group or several groups of the probed types): the step of
:func:`probed_decode_step` decides the no-op case itself
(:func:`decode.is_noop_decode`) and hands a step that needs, fills or
releases a block to the filling step (:mod:`fill_path`). Whatever they do
not settle returns :data:`TAKE_GENERAL_PATH`, and the general path stays the
definition. ``self`` names the coordinator.

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

from pagedkv.optimized.native import DECODE, DecodeContext
from pagedkv.optimized.paths.decode import DecodeProbe, is_noop_decode, native_rules
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.spec.request import RequestView

if TYPE_CHECKING:
    from pagedkv.optimized.paths.coordinated import CoordinatorState

__all__ = ["TAKE_GENERAL_PATH", "DecodeStep", "probed_decode_step"]

TAKE_GENERAL_PATH = KVCacheBlocks((), [])
"""What :meth:`KVCacheCoordinator.decode_step` answers when it does not
settle a step itself: take the general path (the spec's steps), which
validates and raises. A distinct object compared by identity, never handed
out (an enum member costs a class-attribute lookup on the hottest path)."""

DecodeStep = Callable[[RequestView, int, bool], "KVCacheBlocks | None"]
"""``decode_step(request, num_new_tokens, delay_cache_blocks)``: the result,
or :data:`TAKE_GENERAL_PATH`."""


def probed_decode_step(self: CoordinatorState, probes: tuple[DecodeProbe, ...],
                       fill: DecodeStep | None = None) -> DecodeStep:
    """The decode step of every covered configuration, one full-attention
    group included: the one function that decides a decode step (a closure
    over the tables it reads: a cell load is cheaper than an attribute load,
    and this runs on most ``allocate_slots`` calls).

    ``step(request, num_new_tokens, delay_cache_blocks)`` is
    ``allocate_slots(request, num_new_tokens, delay_cache_blocks=...)`` with
    no other argument (``num_new_tokens``: an int >= 1, checked by the
    caller). A known request whose step needs no block, fills none and
    releases none in any group (:func:`decode.is_noop_decode`): the shared
    empty result, nothing created. Any other known request: ``fill(request,
    num_new_tokens, delay_cache_blocks)`` (``fill_path``, D-PERF-37) when
    given, else :data:`TAKE_GENERAL_PATH`. An unknown request, or anything
    the general path would reject (a malformed count, max_model_len
    exceeded, too few block hashes): :data:`TAKE_GENERAL_PATH`.
    ``num_tokens`` is read only from a class not in the coordinator's
    ``well_formed_request_types`` (an int >= 1 by construction for those,
    D-PERF-22); for a counted class the no-op test counts the filled blocks
    by ``total``, an upper bound of ``min(total, num_tokens)``.

    In a native build the installed step is its C twin,
    ``_decode.decode_step`` bound to a :class:`DecodeContext`, which answers
    the no-op case and hands this step everything else (D-PERF-50).

    Cost: O(groups), or the fill's."""
    general = TAKE_GENERAL_PATH
    max_model_len = self.max_model_len
    caching = self.enable_caching
    hash_block_size = self.hash_block_size
    empty = self.empty_blocks
    counted = self.well_formed_request_types  # the set itself: an adapter may add to it later

    def step(request: RequestView, num_new_tokens: int,
             delay_cache_blocks: bool) -> KVCacheBlocks | None:
        num_tokens = 0  # not read: a counted class
        try:
            num_computed = request.num_computed_tokens
            if request.__class__ not in counted:  # the general path's check 1b'
                num_tokens = request.num_tokens
                if type(num_tokens) is not int or num_tokens < 1:
                    return TAKE_GENERAL_PATH
        except AttributeError:
            return TAKE_GENERAL_PATH  # not a request: the general path raises
        if type(num_computed) is not int:
            return TAKE_GENERAL_PATH
        total = num_computed + num_new_tokens
        if not num_new_tokens <= total <= max_model_len:
            return TAKE_GENERAL_PATH
        cache_tokens = -1  # the step caches nothing
        if caching and not delay_cache_blocks:
            # The blocks filled are min(total, num_tokens) // b. A counted
            # class's count is left unread (a property call on the hottest
            # line): total bounds it from above, so a step that fills no
            # block by total fills none; the filling step reads the count.
            cache_tokens = total if not num_tokens or total < num_tokens else num_tokens
        try:
            # Hashes falling short of the blocks to cache: the filling step
            # sends the step to the general path, which raises.
            if cache_tokens // hash_block_size <= len(request.block_hashes) and is_noop_decode(
                    probes, request.request_id, num_computed, total, cache_tokens):
                return empty
        except TypeError:
            return TAKE_GENERAL_PATH  # an unhashable id: the general path raises
        # Some group has work (or the request is unknown): the filling step,
        # which checks the request, or the general path.
        return general if fill is None else fill(request, num_new_tokens, delay_cache_blocks)

    rules = None if DECODE is None else native_rules(self.managers, probes)
    if DECODE is None or rules is None:
        return step
    # The no-op case in C, everything else handed to step (D-PERF-50).
    context = DecodeContext(python_step=step, rules=rules, counted=counted, max_model_len=max_model_len,
                            caching=bool(caching), hash_block_size=hash_block_size, empty=empty)
    return cast("DecodeStep", partial(DECODE.decode_step, context))
