"""The fused admission call and the lookup's memo in C (D-PERF-48).

``_native.admit`` promises to be the separate loops run in turn (touch the
hit, take the new blocks, key the fresh run: map_run then key_run) and
nothing else; ``prefix_hits(..., owner)`` promises to leave the memo
``hit_memo.remember`` leaves. Each is held here to that promise on twin
pools: one gets the fused call, the other the separate ones, and every
result and every list of the pool (ref counts, keys, links, maps, the map
epoch) must agree. The admission step's own tests (test_admit_path.py) and
the lockstep machines cover the manager around it.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pagedkv.optimized import BlockPool
from pagedkv.optimized.native import NATIVE, AdmitContext
from pagedkv.optimized.pool.hasher import make_block_hasher
from pagedkv.optimized.pool.hit_memo import remember
from pagedkv.spec import Request
from pagedkv.spec.types import BlockHash

needs_native = pytest.mark.skipif(NATIVE is None, reason="built without the C module")


def state(pool: BlockPool) -> tuple[Any, ...]:
    queue = pool._queue
    return (list(pool._ref), list(pool._hash), list(pool._gid), list(pool._key_tokens), queue.to_list(),
            queue.size, [dict(t) for t in pool.cached_by_group], [dict(d) for d in pool.dup_by_group],
            pool.map_epoch)


def build(num_blocks: int, history: list[int]) -> tuple[BlockPool, list[int]]:
    """A pool with some keyed blocks, some held, some free and keyed (evictable at the front too)."""
    pool = BlockPool(num_blocks, True)
    hasher = make_block_hasher("sha256", 1)
    held: list[int] = []
    for step, seed in enumerate(history):
        free = pool.get_num_free_blocks()
        if seed % 3 and free:
            blocks = pool.get_new_blocks(min(free, 1 + seed % 4))
            request = Request(f"h{step}", [seed * 7 + i for i in range(len(blocks))], block_hasher=hasher)
            pool.cache_full_blocks(request, blocks, block_hashes=request.block_hashes, num_cached_blocks=0,
                                   num_full_blocks=len(blocks) - (seed % 2), block_size=1, group_id=0)
            held += blocks
        elif held:
            start = seed % len(held)
            chosen = held[start:start + 1 + seed % 5]
            del held[start:start + len(chosen)]
            pool.free_blocks(chosen[::-1])
    return pool, held


def context(pool: BlockPool, block_size: int) -> AdmitContext:
    """The admission's context, as admit_path builds it."""
    queue = pool._queue
    return AdmitContext(pool._ref, queue.prev, queue.next, queue.sentinel, pool._hash, pool._gid, pool._key_tokens,
                        pool.cached_by_group[0], pool._evict,
                        (pool._gid, pool.cached_by_group, pool.dup_by_group, pool), block_size)


def lists(pool: BlockPool) -> Any:
    return context(pool, 0)[:-1]


def separate(pool: BlockPool, blocks: list[int], missing: int, keys: Any, num_full: int,
             block_size: int) -> tuple[Any, ...] | None:
    """What admit's docstring says it runs, call by call."""
    assert NATIVE is not None
    ref, prev, nxt, sentinel, hashes, gids, key_tokens, table, evict, maps = lists(pool)
    held = len(blocks)
    moved = NATIVE.touch(ref, prev, nxt, blocks) if held else 0
    if moved is None:
        return None
    new = NATIVE.take(ref, hashes, prev, nxt, sentinel, missing, evict, maps)
    if new is None:
        return (moved, None, None)
    blocks += new
    keyed = None
    if num_full > held and type(keys) is list and num_full <= len(keys):
        run, run_keys = new[:num_full - held], keys[held:num_full]
        keyed = NATIVE.map_run(table, run_keys, run)
        if keyed:
            assert NATIVE.key_run(hashes, gids, key_tokens, run, run_keys, 0, (held + 1) * block_size,
                                  block_size)
    return (moved, new, keyed)


@needs_native
@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(3, 60), history=st.lists(st.integers(0, 10**6), max_size=12),
       picks=st.lists(st.integers(0, 10**6), max_size=6), share=st.floats(0.1, 1.3),
       fresh_keys=st.integers(1, 12), reuse=st.sampled_from([0, 0, 1, 2]), extra=st.integers(-1, 3),
       block_size=st.integers(1, 16), as_tuple=st.sampled_from([False, False, False, True]))
def test_admit_is_the_separate_loops_in_turn(num_blocks: int, history: list[int], picks: list[int],
                                            share: float, fresh_keys: int, reuse: int, extra: int,
                                            block_size: int, as_tuple: bool) -> None:
    assert NATIVE is not None
    fused_pool, held = build(num_blocks, history)
    split_pool, _ = build(num_blocks, history)
    keyed_blocks = [b for b in range(1, num_blocks) if fused_pool._gid[b] >= 0]
    hit = [keyed_blocks[p % len(keyed_blocks)] for p in picks] if keyed_blocks else []
    # New blocks: a share of what stays free once the hit is touched (past 1: the take declines).
    free = fused_pool.get_num_free_blocks() - len({b for b in hit if fused_pool._ref[b] == 0})
    missing = int(share * free)
    # Fresh keys, sometimes one the map holds already (map_run then declines) or one twice.
    cached = list(fused_pool.cached_by_group[0])
    keys: list[bytes] = [bytes([7, i, len(hit)]) * 11 for i in range(len(hit) + fresh_keys)]
    if reuse == 1 and cached and len(keys) > len(hit):
        keys[len(hit)] = cached[-1]
    if reuse == 2 and len(keys) > len(hit) + 1:
        keys[-1] = keys[len(hit)]
    num_full = max(0, len(hit) + min(missing, fresh_keys) + (extra if extra < 2 else 0))
    given_keys: Any = tuple(keys) if as_tuple else keys
    fused_blocks, split_blocks = list(hit), list(hit)
    before = state(fused_pool)
    fused = NATIVE.admit(context(fused_pool, block_size), fused_blocks, missing, given_keys, num_full)
    split = separate(split_pool, split_blocks, missing, given_keys, num_full, block_size)
    assert fused == split
    assert fused_blocks == split_blocks
    for pool, result in ((fused_pool, fused), (split_pool, split)):
        if result is not None:  # the caller's bookkeeping, as admit_path does it
            pool._queue.size -= result[0] + (len(result[1]) if result[1] is not None else 0)
    assert state(fused_pool) == state(split_pool)
    if fused is None:
        assert state(fused_pool) == before


@needs_native
def test_admit_declines_what_touch_declines_and_changes_nothing() -> None:
    assert NATIVE is not None
    pool, _ = build(10, [1, 2, 4, 5])
    before = state(pool)
    bound = context(pool, 1)
    assert NATIVE.admit(bound, [1, 99], 1, [], 0) is None  # an id outside the pool
    odd: Any = (1,)
    assert NATIVE.admit(bound, odd, 1, [], 0) is None  # not a list
    assert state(pool) == before
    with pytest.raises(TypeError, match="context tuple"):
        NATIVE.admit(tuple(bound)[:-1], [], 1, [], 0)  # type: ignore[arg-type]


@needs_native
def test_admit_leaves_unkeyed_what_key_run_would_not_take() -> None:
    # key_tokens shorter than the ids taken: key_run would decline, so the map is not touched either.
    assert NATIVE is not None
    pool = BlockPool(8, True)
    ref, prev, nxt, sentinel, hashes, gids, _, table, evict, maps = lists(pool)
    short: list[int] = [0]
    bound = AdmitContext(ref, prev, nxt, sentinel, hashes, gids, short, table, evict, maps, 16)
    done = NATIVE.admit(bound, [], 2, [BlockHash(b"k" * 32), BlockHash(b"l" * 32)], 2)
    assert done == (0, [1, 2], None)
    assert table == {} and gids[1:3] == [-1, -1]


@needs_native
@pytest.mark.parametrize("as_tuple", [False, True])
def test_lookup_leaves_the_memo_remember_leaves(as_tuple: bool) -> None:
    assert NATIVE is not None
    pool = BlockPool(16, True)
    blocks = pool.get_new_blocks(4)
    hasher = make_block_hasher("sha256", 2)
    request = Request("r", list(range(9)), block_hasher=hasher)
    pool.cache_full_blocks(request, blocks, block_hashes=request.block_hashes, num_cached_blocks=0,
                           num_full_blocks=4, block_size=2, group_id=0)
    pool.map_epoch = 5
    hashes: Any = tuple(request.block_hashes) if as_tuple else list(request.block_hashes)
    hit = NATIVE.prefix_hits(pool.cached_by_group[0], hashes, 3, pool)
    assert hit == blocks[:3]
    memo = pool.last_hit
    remember(pool, hashes, hit)
    assert memo == pool.last_hit and memo is not None
    assert memo[0] == 5 and all(a is b for a, b in zip(memo[1], hashes[:3], strict=True))
    assert type(memo[1]) is list and memo[2] == hit and memo[2] is not hit
    pool.last_hit = None
    assert NATIVE.prefix_hits(pool.cached_by_group[0], [b"x" * 32], 1, pool) == []
    assert pool.last_hit is None  # an empty hit leaves no memo, as the coordinator leaves none
