"""The admission fast path of ``allocate_slots``: what a coordinator installs
as :attr:`KVCacheCoordinator.admit_step` (D-PERF-17).

The twin of :mod:`decode_path` for the other common call: a request the
manager does not know yet, usually with a prefix hit, on a model of one
full-attention group hashed at its block size with caching on (the
:class:`UnitaryCoordinator` case). The general path runs the spec's steps
through the coordinator and the group manager, each written for any number
of groups of any type; for this configuration most of that dispatch decides
nothing. The step below is those steps for this one case, in the same order,
with the features that cannot apply settled once when it is built, not per
call: no other group, no skipped token (full attention), no window cap, no
Mamba checkpoint, no cross-attention encoder count, no view of the hashes at
another block size, no cache mask.

It takes the request's facts (:class:`RequestFacts`, captured by the facade
before anything else; with kv-cache events off it reads only ``request_id``,
``num_tokens``, ``num_computed_tokens`` and ``block_hashes`` of them, all
before the first change, so ``pagedkv.vllm`` passes vLLM's own ``Request``
there, D-PERF-23) and decides step 1 only where every argument is well
formed; anything else (a known request, a malformed or stale hit, a count of
the wrong type, max_model_len exceeded) returns :data:`TAKE_GENERAL_PATH`
before any change, and the general path, which stays the definition, raises
the spec's error. ``test_admit_path`` holds the two to the same results,
state, events and errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from operator import is_
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from pagedkv.optimized.native import NATIVE, AdmitContext
from pagedkv.optimized.paths.capacity import refuses
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH
from pagedkv.optimized.paths.recovery import recover
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.optimized.pool.pool_caching import cache_new_run
from pagedkv.spec.request import RequestFacts
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.optimized.paths.coordinated import CoordinatorState

__all__ = ["AdmitStep", "single_admit_step"]

class AdmitStep(Protocol):
    """``admit_step(facts, num_new_tokens, num_new_computed_tokens,
    new_computed_blocks, delay_cache_blocks, reserved_blocks, watermark_blocks,
    num_in_flight_tokens, full_sequence_must_fit)``: the result, or
    :data:`TAKE_GENERAL_PATH`. The other arguments of ``allocate_slots`` are at
    their defaults (the facade checks). With ``raw`` (an adapter's call,
    D-PERF-34) the hit is the one group's list of block ids (or ``None``) and
    the result the list of new block ids instead of a :class:`KVCacheBlocks`;
    everything else is the same."""

    @overload
    def __call__(self, facts: RequestFacts, num_new_tokens: int, num_new_computed_tokens: int,
                 new_computed_blocks: Any, delay_cache_blocks: bool, reserved_blocks: int,
                 watermark_blocks: int, num_in_flight_tokens: int, full_sequence_must_fit: bool,
                 raw: Literal[False] = False) -> KVCacheBlocks | None: ...

    @overload
    def __call__(self, facts: RequestFacts, num_new_tokens: int, num_new_computed_tokens: int,
                 new_computed_blocks: Any, delay_cache_blocks: bool, reserved_blocks: int,
                 watermark_blocks: int, num_in_flight_tokens: int, full_sequence_must_fit: bool,
                 raw: Literal[True]) -> KVCacheBlocks | list[int] | None: ...


def single_admit_step(self: CoordinatorState) -> AdmitStep:
    """The admission step for one full-attention group hashed at its block
    size, caching on (a closure over the tables it reads, as
    :func:`decode_path.probed_decode_step`; in a native build its pool work
    is one C call, ``_native.admit``, D-PERF-48).

    ``step(facts, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
    delay_cache_blocks, reserved_blocks, watermark_blocks, num_in_flight_tokens,
    full_sequence_must_fit)`` is ``allocate_slots`` with those arguments for
    a request the manager does not know. Step 1 for that case: every count an int of its range, nothing
    computed yet, the hit this manager's ``KVCacheBlocks`` of one group
    whose blocks are exactly the ones the cache map serves for the request's
    hashes (checks 1h, 1h' and 1i at once, as ``validation._hit_holds``)
    covering ``num_new_computed_tokens``, and max_model_len kept. Then steps
    4 to 9: the demand (new blocks plus hit blocks leaving the free queue)
    against the free queue less ``reserved_blocks`` and ``watermark_blocks``
    (``None`` when short, nothing changed), admit the hit, allocate, cache
    the blocks the computed tokens fill, return the new blocks. With
    ``full_sequence_must_fit`` the blocks the whole request needs must fit
    too, with the watermark only kept free (a chunked prefill, D-PERF-19,
    D-API-48): on one full-attention group that is the general path's
    ``max(chunk demand + reserved_blocks, full_sequence_demand) +
    watermark_blocks``, as both demands add the same hit blocks leaving the
    free queue.

    Cost: O(hit blocks + new blocks + blocks newly cached).
    """
    manager = self.managers[0]
    blocks_of = manager.req_to_blocks
    cached_of = manager.num_cached_blocks
    block_size = self.block_sizes[0]
    max_model_len = self.max_model_len
    requests = self.requests
    pool = self.block_pool
    queue = pool._queue
    ref = pool._ref
    table_get = pool.cached_by_group[0].get
    hashes = pool.block_hashes  # the pool's live list (cleared in place, never replaced)
    own_blocks = KVCacheBlocks
    zero = 0
    # The pool's work in one C call (D-PERF-48: touch, take, key the fresh
    # run; the same loops BlockPool.touch_held, get_new_blocks and
    # cache_new_run run, each declining what it does not cover), where it
    # applies: events off, as the take loop evicts in place only then
    # (moving the pool's map epoch itself, D-PERF-44). The lists are the
    # pool's own, changed in place only (pool_recover).
    admit = None if NATIVE is None else partial(NATIVE.admit, AdmitContext(
        pool._ref, queue.prev, queue.next, queue.sentinel, pool._hash, pool._gid, pool._key_tokens,
        pool.cached_by_group[0], pool._evict,
        (pool._gid, pool.cached_by_group, pool.dup_by_group, pool),  # the pool: owner of the epoch
        block_size))

    def finish(facts: RequestFacts, blocks: list[int], done: tuple[int, list[int] | None, bool | None] | None,
               held: int, missing: int, num_full: int, block_hashes: Sequence[BlockHash], request_id: str,
               raw: bool) -> Any:
        """ALLOC-6 to ALLOC-9 after the pool call (``done``: what ``_native.admit``
        answered, or None when it was not called or declined its first loop),
        for what that call left undone; the step's tail, also called by the C
        step (D-PERF-49). An exception propagates to the caller, which recovers."""
        keyed = None
        if done is None:  # ALLOC-6 and ALLOC-7 by the methods: the pure build, events on
            if held:
                pool.touch_held(blocks)
            new_blocks = pool.get_new_blocks(missing)
            blocks.extend(new_blocks)
        else:
            moved, taken, keyed = done
            queue.size -= moved
            if taken is None:  # ALLOC-7 declined by the C loop: the method
                new_blocks = pool.get_new_blocks(missing)
                blocks.extend(new_blocks)
            else:
                new_blocks = taken
                queue.size -= missing
        # ALLOC-8: keyed in the C call already, or a run of fresh blocks
        # (blocks[held:], ALLOC-7's) keyed in bulk without events (the
        # pool's first attempt, pool_caching.cache_new_run, which changes
        # nothing when it declines), or block by block.
        if num_full > held:
            if keyed is False or keyed is None and (pool.enable_kv_cache_events or not cache_new_run(
                    pool, new_blocks[:num_full - held], block_hashes[held:num_full], 0, held,
                    block_size, True)):
                pool.cache_full_blocks_unchecked(
                    facts, blocks, block_hashes=block_hashes, num_cached_blocks=held,
                    num_full_blocks=num_full, block_size=block_size, group_id=0, mask=None)
            cached_of[request_id] = num_full
        # ALLOC-9: the blocks of ALLOC-7.
        return new_blocks if raw else own_blocks((new_blocks,), hashes)

    def step(facts: RequestFacts, num_new_tokens: int, num_new_computed_tokens: int,
             new_computed_blocks: Any, delay_cache_blocks: bool, reserved_blocks: int,
             watermark_blocks: int, num_in_flight_tokens: int,
             full_sequence_must_fit: bool, raw: bool = False) -> Any:
        request_id = facts.request_id
        num_tokens = facts.num_tokens
        # ALLOC-1, checks 1a-1b'' (spec.allocate_args.check_counts) for a new request; identity
        # with the cached int 0 lets only an int through (0.0 and False: general).
        if (type(request_id) is not str or request_id in requests or facts.num_computed_tokens is not zero
                or type(num_new_tokens) is not int or num_new_tokens < 1
                or type(num_new_computed_tokens) is not int or num_new_computed_tokens < 0
                or type(reserved_blocks) is not int or reserved_blocks < 0
                or type(watermark_blocks) is not int or watermark_blocks < 0
                or type(num_in_flight_tokens) is not int or num_in_flight_tokens < 0
                or type(num_tokens) is not int or num_tokens < 1):
            return TAKE_GENERAL_PATH
        # 1c-1f: this manager's blocks, one group, whole blocks covering the hit.
        if new_computed_blocks is None:
            hit: list[int] = []
        elif raw:
            hit = new_computed_blocks  # the group's ids: checked below as any hit's
        elif type(new_computed_blocks) is own_blocks and len(new_computed_blocks.blocks) == 1:
            hit = new_computed_blocks.blocks[0]
        else:
            return TAKE_GENERAL_PATH
        held = len(hit)
        main = num_new_computed_tokens + num_new_tokens
        if num_new_computed_tokens != held * block_size or main > max_model_len:
            return TAKE_GENERAL_PATH  # 1f or 1j: the general path raises
        block_hashes = facts.block_hashes
        if held:
            # 1h, 1h', 1i: exactly ints, each the block the map serves for
            # the request's hash at its position (so in the pool, not null,
            # still keyed there: CACHE-1); proven by the lookup's memo when
            # the hit is the one it found, else probed (D-PERF-44).
            memo = pool.last_hit  # hit_memo.vouches, inline: three calls less per admission (D-PERF-48)
            if not (memo is not None and memo[0] == pool.map_epoch and type(hit) is list
                    and len(hit) == len(memo[2]) and len(block_hashes) >= len(memo[1])
                    and all(map(is_, hit, memo[2])) and all(map(is_, block_hashes, memo[1]))) and (
                    type(hit) is not list or held > len(block_hashes)
                    or list(map(type, hit)).count(int) != held
                    or list(map(table_get, block_hashes[:held])) != hit):
                return TAKE_GENERAL_PATH
        # ALLOC-4 (no Mamba group here), ALLOC-5: the demand: new blocks (at least one: num_new_tokens >= 1 past
        # whole hit blocks), plus hit blocks with no holder (they leave the
        # free queue when taken), counted only when the bound with every hit
        # block free would not fit.
        missing = -(-main // block_size) - held
        demand = missing + reserved_blocks
        if full_sequence_must_fit:
            # spec/managers.md §8 on one full-attention group: the whole
            # request (capped at max_model_len, as the general path caps it),
            # which keeps the watermark free but not reserved_blocks (D-API-48).
            whole = -(-(num_tokens if num_tokens < max_model_len else max_model_len) // block_size) - held
            if whole > demand:
                demand = whole
        demand += watermark_blocks
        if refuses(queue.size, demand, hit, ref):
            return None  # D-API-13, D-API-48
        # The changes: an exception from here on leaves a consistent manager (D-API-24).
        try:
            # ALLOC-6: admit: the request's own list, its hit taken (touched).
            requests.add(request_id)
            blocks = list(hit)
            blocks_of[request_id] = blocks
            cached_of[request_id] = held
            # ALLOC-8's extent: the blocks the computed tokens fill, as far as the
            # request has hashes (D-API-11).
            num_full = 0
            if not delay_cache_blocks:
                num_full = (main if main < num_tokens else num_tokens) // block_size
                if num_full > len(block_hashes):
                    num_full = len(block_hashes)
            done = None if admit is None or pool.enable_kv_cache_events else admit(
                blocks, missing, block_hashes, num_full)
            if done is not None and done[1] is not None and (num_full <= held or done[2] is True):
                # The pool call did ALLOC-6 to ALLOC-8 (the common case).
                queue.size -= done[0] + missing
                if num_full > held:
                    cached_of[request_id] = num_full
                return done[1] if raw else own_blocks((done[1],), hashes)  # ALLOC-9
            return finish(facts, blocks, done, held, missing, num_full, block_hashes, request_id, raw)
        except BaseException:
            recover(self)
            raise

    return step
