"""The filling branch of the decode fast path (D-PERF-37), any probed configuration.

:func:`decode_path.probed_decode_step` settles a decode step of a known
request when no group needs a block, fills one or releases one. Every
sixteenth step or so (at block size 16) some group does, and the step used
to take the general path: capture the request's facts, validate every
argument, dispatch each of the spec's steps to every group through the
coordinator. For the arguments such a step has (no hit, lookahead,
external or encoder tokens, nothing reserved or in flight, no whole-request
gate) most of that decides nothing. The step built here does what the
general path does in that case, in the same order and with the same calls
into the pool, so block ids, events and errors cannot differ:

3. every group releases the blocks attention no longer reads (on the
   settled basis: all computed tokens, none in flight);
4-5. the demand, group by group, against the free queue (``None`` when
   short, the releases kept, D-API-6);
7. every group appends the blocks it needs;
8. the blocks the step fills are cached: by ``coordinator.cache_blocks``
   itself (every group's view, mask and alignment rule), or inline when every
   group is a plain type hashed at its block size with no EAGLE rule or cache
   mask (then that method comes down to the pool's ``cache_full_blocks`` per
   group: the block size is the alignment);
9. the new blocks per group, or the shared empty result.

Groups of the plain types (full attention, sliding window, chunked local:
the base class's rules, no override) run those rules inline; any other
probed type (Mamba, ring) is called through its own methods, which stay the
definition. The request's facts are captured first, as the general path
does, so no engine code runs once something has changed; anything the
general path would refuse goes back to it before any change
(:data:`TAKE_GENERAL_PATH`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedkv.optimized.groups.single_type import FullAttentionManager, SingleTypeManager
from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.optimized.paths.capacity import refuses
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH
from pagedkv.optimized.paths.recovery import recover
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.spec.request import RequestFacts, RequestView

if TYPE_CHECKING:
    from pagedkv.optimized.paths.coordinated import CoordinatorState

__all__ = ["FillStep", "probed_fill_step"]

FillStep = Callable[[RequestView, int, bool], "KVCacheBlocks | None"]
"""``fill(request, num_new_tokens, delay_cache_blocks)``: the result, or
:data:`TAKE_GENERAL_PATH`."""

_PLAIN = (FullAttentionManager, SlidingWindowManager, ChunkedLocalAttentionManager)
"""Exact classes whose release, demand and allocation are the base class's."""


def probed_fill_step(self: CoordinatorState) -> FillStep | None:
    """The filling step for this coordinator's groups, or ``None`` when a
    Mamba group keeps prefill checkpoints (every step records or forgets
    one: the general path's business). ``self`` is the coordinator.

    ``fill(request, num_new_tokens, delay_cache_blocks)`` is
    ``allocate_slots(request, num_new_tokens, delay_cache_blocks=...)`` with
    every other argument at its default, for a request the manager knows.
    Cost: O(groups + blocks released, allocated and newly cached).
    """
    managers = self.managers
    if any(getattr(manager, "has_checkpoints", False) for manager in managers):
        return None
    # Per group: (manager, block size, block lists, cached counts, skip rule):
    # the skip rule is None for full attention (it releases nothing); the
    # block size is 0 for a type called through its own methods.
    groups: list[tuple[SingleTypeManager, int, dict[str, list[int]], dict[str, int],
                       Callable[[int], int] | None]] = []
    for manager in managers:
        kind = type(manager)
        plain = kind in _PLAIN
        released = manager.skipped_tokens if plain and kind is not FullAttentionManager else None
        groups.append((manager, manager.block_size if plain else 0, manager.req_to_blocks,
                       manager.num_cached_blocks, released))
    # Caching inline (the base class's cache_blocks under the coordinator's
    # rule) when every group is plain, prefix-cacheable, without EAGLE or a
    # cache mask, hashed at its block size; else coordinator.cache_blocks.
    inline_cache = all(
        size and cacheable and not manager.use_eagle and size == self.hash_block_size
        and (type(manager) is not SlidingWindowManager
             or (manager.retention_interval is None and manager.alignment == size))
        for (manager, size, _, _, _), cacheable in zip(groups, self.cacheable))
    # The groups coordinator.cache_blocks reaches, with each one's block size.
    cached_groups = tuple((group[3], group[0].block_size) for group, cacheable in zip(groups, self.cacheable)
                          if cacheable)
    requests = self.requests
    pool = self.block_pool
    queue = pool._queue
    get_new_blocks = pool.get_new_blocks
    free_held = pool.free_held
    cache_full_blocks = pool.cache_full_blocks
    caching = self.enable_caching
    max_model_len = self.max_model_len
    hash_block_size = self.hash_block_size
    empty = self.empty_blocks
    hashes = pool.block_hashes  # the pool's live list (cleared in place, never replaced)
    capture = RequestFacts.capture
    capturers = self.request_facts_readers  # the dict itself: an adapter may register later
    counted = self.well_formed_request_types  # the set itself, likewise
    coordinator = self

    def fill(request: RequestView, num_new_tokens: int, delay_cache_blocks: bool) -> KVCacheBlocks | None:
        # The general path's first act: every read of the engine's object
        # (for an adapter's request class, the snapshot its general path
        # takes). pagedkv's own request classes with events off need none, by
        # D-PERF-43's argument: no engine code behind their attributes, and
        # nothing reads past what they hold (D-PERF-50).
        kind = request.__class__
        facts: Any
        if kind in counted and kind not in capturers and not pool.enable_kv_cache_events:
            facts = request
        else:
            facts = capturers.get(kind, capture)(request)
        request_id = facts.request_id
        num_computed = facts.num_computed_tokens
        num_tokens = facts.num_tokens
        # ALLOC-1 for this case: a known request, well-formed counts,
        # max_model_len kept; otherwise the general path raises.
        if (type(request_id) is not str or request_id not in requests
                or type(num_computed) is not int or num_computed < 0
                or type(num_tokens) is not int or num_tokens < 1
                or type(num_new_tokens) is not int or num_new_tokens < 1):
            return TAKE_GENERAL_PATH
        main = num_computed + num_new_tokens
        if main > max_model_len:
            return TAKE_GENERAL_PATH
        cache = caching and not delay_cache_blocks
        cache_tokens = main if main < num_tokens else num_tokens
        block_hashes = facts.block_hashes
        if cache and cache_tokens // hash_block_size > len(block_hashes):
            return TAKE_GENERAL_PATH  # as the probed step: hashes short of the blocks to cache
        try:
            # ALLOC-3: release what attention no longer reads (D-API-6: kept on
            # refusal), group by group; each group's demand (ALLOC-4) beside it:
            # a release changes no other group's count.
            demand = 0
            needs: list[int] = []
            for manager, block_size, blocks_of, _, released in groups:
                if not block_size:
                    manager.remove_skipped_blocks(request_id, num_computed)
                    missing = manager.get_num_blocks_to_allocate(request_id, main, (), num_computed, main, 0)
                    demand += missing
                    needs.append(missing)
                    continue
                blocks = blocks_of[request_id]
                if released is not None:
                    skipped = released(num_computed)
                    if skipped >= block_size:
                        index = skipped // block_size
                        index = (index if index < len(blocks) else len(blocks)) - 1
                        if index >= 0 and blocks[index]:
                            freed: list[int] = []
                            while index >= 0 and blocks[index]:
                                freed.append(blocks[index])
                                blocks[index] = 0
                                index -= 1
                            free_held(freed)
                missing = -(-main // block_size) - len(blocks)
                if missing > 0:
                    demand += missing
                needs.append(missing)
            # ALLOC-5.
            if refuses(queue.size, demand):
                return None
            # ALLOC-7: allocate, group by group.
            new_blocks: list[list[int]] = []
            added = False
            for (manager, block_size, blocks_of, _, _), missing in zip(groups, needs):
                if not block_size:
                    taken = manager.allocate_new_blocks(request_id, main, main)
                elif missing > 0:
                    taken = get_new_blocks(missing)
                    blocks_of[request_id].extend(taken)
                else:
                    taken = []
                if taken:
                    added = True
                new_blocks.append(taken)
            # ALLOC-8: cache the blocks the step fills.
            if cache:
                if inline_cache:
                    # Every block size is the hash block size, so the
                    # alignment too: whole blocks are whole alignment units.
                    for manager, block_size, blocks_of, cached_of, _ in groups:
                        num_full = cache_tokens // block_size
                        num_cached = cached_of[request_id]
                        if num_cached < num_full:
                            cache_full_blocks(facts, blocks_of[request_id], block_hashes=block_hashes,
                                              num_cached_blocks=num_cached, num_full_blocks=num_full,
                                              block_size=block_size, group_id=manager.group_id, mask=None)
                            cached_of[request_id] = num_full
                else:
                    # coordinator.cache_blocks caches no group's block past
                    # cache_tokens (its counts only shrink it): skipped when
                    # no group could cache one, which most steps are (its one
                    # other store, a Mamba group's caching_end, is read only
                    # within a caching call, with sub-block hits).
                    for cached_of, size in cached_groups:
                        if cache_tokens // size > cached_of[request_id]:
                            coordinator.cache_blocks(request=facts, request_id=request_id,
                                                     num_tokens=cache_tokens)
                            break
            # ALLOC-9.
            return KVCacheBlocks(tuple(new_blocks), hashes) if added else empty
        except BaseException:
            recover(coordinator)
            raise

    return fill
