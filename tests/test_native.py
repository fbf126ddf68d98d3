"""The optional C loops of the block pool (``optimized/_native.c``, D-PERF-26)
against the Python loops they replace.

Two pools are driven through the same random operations, one with the C
module and one with ``block_pool.NATIVE`` switched off around each call;
after every operation their whole state must be equal, list for list
(ref counts, keys, free-queue links, sizes, maps, events). A second set
hands the C functions what the pool never stores (subclasses, stray types,
ids out of range, huge ints) and demands ``None`` with every list untouched,
so the pool falls back to its Python loop. Skipped, with the reason, in a
build without a C compiler; ``make verify`` also runs the lockstep machines
with ``PAGEDKV_PURE_PYTHON=1`` (the ``test-pure`` gate), so both builds are
checked against the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pagedkv.optimized import BlockPool
from pagedkv.optimized.native import NATIVE, build_name
from pagedkv.optimized.pool import block_pool as block_pool_module
from pagedkv.optimized.pool import pool_caching as pool_caching_module
from pagedkv.optimized.pool.hasher import make_block_hasher
from pagedkv.spec import Request

needs_native = pytest.mark.skipif(NATIVE is None, reason="built without the C module (no C compiler, "
                                  "or PAGEDKV_PURE_PYTHON=1): the Python loops run, nothing to compare")


@contextmanager
def python_loops() -> Iterator[None]:
    """The pool's Python loops for the duration (the module globals the pool reads)."""
    modules = (block_pool_module, pool_caching_module)
    saved = [vars(module)["NATIVE"] for module in modules]
    for module in modules:
        setattr(module, "NATIVE", None)  # noqa: B010 (not re-exported: mypy --strict)
    try:
        yield
    finally:
        for module, native in zip(modules, saved, strict=True):
            setattr(module, "NATIVE", native)  # noqa: B010


def state(pool: BlockPool) -> tuple[Any, ...]:
    queue = pool._queue
    return (list(pool._ref), list(pool._hash), list(pool._gid), list(pool._key_tokens), list(queue.next),
            list(queue.prev), queue.size, [dict(t) for t in pool.cached_by_group],
            [{k: list(v) for k, v in d.items()} for d in pool.dup_by_group], pool.take_events())


def both(native: BlockPool, pure: BlockPool, op: Callable[..., Any]) -> Any:
    """Run ``op`` on each pool (the second with the Python loops): same result or same error type
    (returned: the result, or the error's type)."""
    outcomes = []
    for pool, loops in ((native, None), (pure, python_loops)):
        try:
            if loops is None:
                outcomes.append(("ok", op(pool)))
            else:
                with loops():
                    outcomes.append(("ok", op(pool)))
        except Exception as error:  # compared by type: both builds must refuse alike
            outcomes.append(("error", type(error)))
    assert outcomes[0] == outcomes[1]
    assert state(native) == state(pure)
    return outcomes[0][1]


def test_build_name_names_the_loops_that_run() -> None:
    assert build_name() == ("pure-python" if NATIVE is None else "native")


def test_pure_python_switch_selects_the_python_loops() -> None:
    code = "from pagedkv.optimized.native import NATIVE; print(NATIVE is None)"
    env = {**os.environ, "PAGEDKV_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


OPS = st.lists(st.tuples(st.sampled_from(["take", "take", "touch", "free", "cache", "cache", "evict", "free_dup"]),
                         st.integers(0, 1000)), min_size=20, max_size=100)


@needs_native
@settings(max_examples=100, deadline=None)
@given(ops=OPS, num_blocks=st.integers(2, 40), caching=st.booleans(), events=st.booleans())
def test_native_and_python_loops_leave_identical_pools(ops: list[tuple[str, int]], num_blocks: int,
                                                       caching: bool, events: bool) -> None:
    native = BlockPool(num_blocks, caching, enable_kv_cache_events=events)
    pure = BlockPool(num_blocks, caching, enable_kv_cache_events=events)
    held: list[int] = []  # one entry per reference the test holds
    hasher = make_block_hasher("sha256", 1)
    serial = 0
    for kind, seed in ops:
        if kind == "take":
            free = native.get_num_free_blocks()
            n = free + 1 if seed % 10 == 0 else min(free, seed % 6)  # sometimes one too many: refused alike
            taken = both(native, pure, lambda p, n=n: p.get_new_blocks(n))
            if isinstance(taken, list):
                held += taken
        elif kind == "touch" and caching:
            # Hit blocks: keyed ones, held or free (a free one leaves the queue).
            keyed = [b for b in range(1, num_blocks) if native._gid[b] >= 0]
            free_first = sorted(keyed, key=lambda b: native._ref[b] > 0)
            picked = free_first[seed % 2:][:1 + seed % 5] + ([0] if seed % 5 == 0 else [])
            both(native, pure, lambda p, picked=picked: p.touch(picked))
            held += [b for b in picked if b]
        elif kind == "free" and held:
            start = seed % len(held)
            chosen = held[start:start + 1 + seed % 7]
            del held[start:start + len(chosen)]
            chosen.reverse()
            both(native, pure, lambda p, chosen=chosen: p.free_blocks(chosen))
        elif kind == "free_dup":
            # A block named twice in one call (D-API-35): released where its count reaches 0.
            twice = sorted(b for b in set(held) if held.count(b) >= 2)
            if twice:
                block = twice[seed % len(twice)]
                held.remove(block)
                held.remove(block)
                both(native, pure, lambda p, block=block: p.free_blocks([block, block]))
        elif kind == "cache" and caching and any(native._gid[b] < 0 for b in held):
            # Mostly unkeyed blocks (the bulk path takes only those), every other one at times:
            # scattered runs too, not only slices of ids.
            distinct = sorted(b for b in set(held) if seed % 4 == 0 or native._gid[b] < 0)
            blocks = (distinct[seed % 2::2] if seed % 3 else distinct)[: 1 + seed % 5] or distinct[:1]
            serial += 1
            request = Request(f"r{serial}", [seed + i for i in range(len(blocks))], block_hasher=hasher)
            both(native, pure, lambda p, blocks=blocks, request=request: p.cache_full_blocks(
                request, blocks, block_hashes=request.block_hashes, num_cached_blocks=0,
                num_full_blocks=len(blocks), block_size=1, group_id=0))
        elif kind == "evict":
            ids = [seed % num_blocks, (seed // 7) % num_blocks]
            both(native, pure, lambda p, ids=ids: p.evict_blocks(ids))


class ListSubclass(list[Any]):
    pass


def pool_with_queue() -> BlockPool:
    pool = BlockPool(8, True)
    pool.get_new_blocks(3)  # ids 1..3 held, 4..7 queued
    return pool


def refused(call: Callable[[], Any], pool: BlockPool) -> None:
    before = state(pool)
    assert call() is None
    assert state(pool) == before


@needs_native
@pytest.mark.parametrize("blocks", [[1, 2.0], [1, True], [1, 8], [1, -1], [1, 2**40], [1, 2**80], ["1"],
                                    [1, 8 + 1]], ids=repr)
def test_release_and_touch_refuse_what_the_pool_never_holds(blocks: list[Any]) -> None:
    assert NATIVE is not None
    pool = pool_with_queue()
    queue = pool._queue
    refused(lambda: NATIVE.release(pool._ref, pool._gid, queue.prev, queue.next, queue.sentinel, blocks), pool)
    refused(lambda: NATIVE.touch(pool._ref, queue.prev, queue.next, blocks), pool)


@needs_native
def test_native_loops_refuse_foreign_containers_and_links() -> None:
    assert NATIVE is not None
    pool = pool_with_queue()
    queue = pool._queue
    ref, gids, prev, nxt = pool._ref, pool._gid, queue.prev, queue.next
    refused(lambda: NATIVE.release(ref, gids, prev, nxt, queue.sentinel, ListSubclass([1])), pool)
    refused(lambda: NATIVE.release(ListSubclass(ref), gids, prev, nxt, queue.sentinel, [1]), pool)
    refused(lambda: NATIVE.release(ref, gids, prev, nxt, 99, [1]), pool)
    a_tuple: Any = (1,)
    refused(lambda: NATIVE.release(ref, gids, prev, nxt, queue.sentinel, a_tuple), pool)
    refused(lambda: NATIVE.touch(ref, prev, nxt[:3], [5]), pool)
    refused(lambda: NATIVE.take(ref, pool._hash, prev, nxt, queue.sentinel, 5, pool._evict), pool)  # 4 free
    refused(lambda: NATIVE.take(ref, pool._hash, prev, nxt, queue.sentinel, -1, pool._evict), pool)
    refused(lambda: NATIVE.take(ref, pool._hash, prev, nxt, queue.sentinel, 2**80, pool._evict), pool)
    refused(lambda: NATIVE.take(ref, (None,) * 8, prev, nxt, queue.sentinel, 1, pool._evict), pool)  # not a list
    hashes, tokens = pool._hash, pool._key_tokens
    two: Any = [b"a", b"b"]  # keys (any objects to the C side); Any: mypy would want BlockHash
    one: Any = [b"a"]
    scattered: Any = [1, 2.0]
    refused(lambda: NATIVE.key_run(hashes, gids, tokens, [1, 8], two, 0, 1, 1), pool)  # 8: no block
    refused(lambda: NATIVE.key_run(hashes, gids, tokens, [1, 2], one, 0, 1, 1), pool)  # a key short
    refused(lambda: NATIVE.key_run(hashes, gids, tokens, [1, 2], two, 0, 2**80, 1), pool)
    refused(lambda: NATIVE.key_run(hashes, gids, tokens, scattered, two, 0, 1, 1), pool)
    # A link that leaves the pool (a corrupted queue): refused before any store.
    nxt[4] = 2**40
    refused(lambda: NATIVE.take(ref, pool._hash, prev, nxt, queue.sentinel, 2, pool._evict), pool)
    nxt[4] = 5


def _two_keyed_at_the_back(events: bool) -> tuple[BlockPool, BlockPool]:
    """Two pools of 6 blocks: 3..5 unkeyed at the queue's front, then 2 and 1 keyed."""
    native, pure = (BlockPool(6, True, enable_kv_cache_events=events) for _ in range(2))
    hasher = make_block_hasher("sha256", 1)
    for pool in (native, pure):
        blocks = pool.get_new_blocks(5)
        request = Request("r", [1, 2, 3, 4, 5], block_hasher=hasher)
        pool.cache_full_blocks(request, blocks, block_hashes=request.block_hashes, num_cached_blocks=0,
                               num_full_blocks=2, block_size=1, group_id=0)
        pool.free_blocks(blocks[::-1])  # 3..5 unkeyed to the front, then 2, 1 keyed at the back
        pool.take_events()
    return native, pure


@needs_native
def test_take_propagates_an_eviction_error_as_the_python_loop_does() -> None:
    # Events on: every eviction goes through the pool's method, here one that fails.
    native, pure = _two_keyed_at_the_back(events=True)

    class FailingEviction(BlockPool):
        __slots__ = ()  # the same layout: the pools below can switch to this class

        def _evict(self, block: int, announce: bool = True) -> None:
            raise RuntimeError(f"evict {block}")

    native.__class__ = pure.__class__ = FailingEviction
    both(native, pure, lambda p: p.get_new_blocks(5))


@needs_native
def test_take_evicts_in_place_as_the_method_does() -> None:
    """Events off: the C loop drops an unduplicated key itself (D-PERF-38),
    leaving what _evict leaves; a key another block duplicates still goes
    through the method (its later holder takes the map's entry)."""
    native, pure = _two_keyed_at_the_back(events=False)
    both(native, pure, lambda p: p.get_new_blocks(5))  # 3..5, then 2 and 1 evicted
    assert native.cached_by_group == [{}] and native._gid[1:] == [-1] * 5
    # Duplicates: blocks 1 and 2 keyed alike (one key, two holders), then taken back.
    native, pure = (BlockPool(6, True) for _ in range(2))
    hasher = make_block_hasher("sha256", 1)
    for pool in (native, pure):
        blocks = pool.get_new_blocks(4)
        for block in blocks[:2]:
            request = Request("r", [7], block_hasher=hasher)
            pool.cache_full_blocks(request, [block], block_hashes=request.block_hashes, num_cached_blocks=0,
                                   num_full_blocks=1, block_size=1, group_id=0)
        pool.free_blocks(blocks[::-1])
    assert native.dup_by_group[0]
    for n in (4, 1):  # the unkeyed ones and the duplicate's first holder, then the other holder
        both(native, pure, lambda p, n=n: p.get_new_blocks(n))
    assert native.cached_by_group == [{}] and native.dup_by_group == [{}]


@needs_native
def test_take_in_place_eviction_of_a_missing_key_fails_as_the_method_does() -> None:
    """A map corrupted under the pool (a key gone): both builds raise KeyError
    from the same place and leave the same partial state."""
    native, pure = _two_keyed_at_the_back(events=False)
    for pool in (native, pure):
        pool.cached_by_group[0].clear()
    both(native, pure, lambda p: p.get_new_blocks(5))


@needs_native
def test_take_refuses_foreign_maps() -> None:
    assert NATIVE is not None
    pool = pool_with_queue()
    queue = pool._queue
    maps: Any = (pool._gid, pool.cached_by_group)  # two of three
    refused(lambda: NATIVE.take(pool._ref, pool._hash, queue.prev, queue.next, queue.sentinel, 1, pool._evict,
                                maps), pool)
    maps = [pool._gid, pool.cached_by_group, pool.dup_by_group]  # a list, not a tuple
    refused(lambda: NATIVE.take(pool._ref, pool._hash, queue.prev, queue.next, queue.sentinel, 1, pool._evict,
                                maps), pool)
    maps = (pool._gid[:2], pool.cached_by_group, pool.dup_by_group)  # group ids short of the blocks: bound
    assert NATIVE.take(pool._ref, pool._hash, queue.prev, queue.next, queue.sentinel, 1, pool._evict,
                       maps) is None


# ---------------------------------------------------------- map_run, prefix_hits (D-PERF-40, D-PERF-41)

keys_drawn = st.lists(st.binary(min_size=1, max_size=2), max_size=12)


def map_run_definition(table: dict[bytes, int], keys: list[bytes], run: list[int]) -> bool:
    """pool_caching.cache_new_run's map step as the Python code writes it."""
    if not table.keys().isdisjoint(keys):
        return False
    expected = len(table) + len(keys)
    table.update(zip(keys, run))
    if len(table) != expected:
        for key in keys:
            table.pop(key, None)
        return False
    return True


@needs_native
@given(existing=st.dictionaries(st.binary(min_size=1, max_size=2), st.integers(1, 50), max_size=8),
       keys=keys_drawn)
def test_map_run_is_the_python_map_step(existing: dict[bytes, int], keys: list[bytes]) -> None:
    assert NATIVE is not None
    run = list(range(100, 100 + len(keys)))
    ours, theirs = dict(existing), dict(existing)
    assert NATIVE.map_run(ours, keys, run) == map_run_definition(theirs, keys, run)
    assert list(ours.items()) == list(theirs.items())  # items and their order


@needs_native
def test_map_run_refuses_what_it_does_not_cover() -> None:
    assert NATIVE is not None
    table = {b"a": 1}
    foreign: list[Any] = [({b"a": 1}, [bytearray(b"x")], [2]), ({b"a": 1}, [b"x"], [2, 3]),
                          ({b"a": 1}, (b"x",), [2])]
    for table, keys, run in foreign:
        before = dict(table)
        assert NATIVE.map_run(table, keys, run) is None
        assert table == before


@needs_native
@given(table=st.dictionaries(st.binary(min_size=1, max_size=1), st.integers(0, 9), min_size=1, max_size=10),
       limit=st.integers(-2, 14), as_tuple=st.booleans(), data=st.data())
def test_prefix_hits_is_the_python_scan(table: dict[bytes, int], limit: int, as_tuple: bool,
                                        data: st.DataObject) -> None:
    assert NATIVE is not None
    # Mostly cached keys, so long prefixes are common; now and then any key.
    hashes = data.draw(st.lists(st.one_of(st.sampled_from(sorted(table)), st.sampled_from(sorted(table)),
                                          st.binary(min_size=1, max_size=1)), max_size=12))
    expected: list[int] = []
    for block_hash in hashes[:max(limit, 0)]:
        if block_hash not in table:
            break
        expected.append(table[block_hash])
    view: Any = tuple(hashes) if as_tuple else hashes
    assert NATIVE.prefix_hits(table, view, limit) == expected


@needs_native
def test_prefix_hits_refuses_foreign_keys_and_containers() -> None:
    assert NATIVE is not None

    class Key(bytes):
        pass

    table = {b"a": 1}
    assert NATIVE.prefix_hits(table, [b"a", Key(b"a")], 2) is None
    assert NATIVE.prefix_hits(table, [b"a", Key(b"a")], 1) == [1]  # only the scanned items are read
    assert NATIVE.prefix_hits(table, iter([b"a"]), 1) is None  # type: ignore[arg-type]
    assert NATIVE.prefix_hits(table, [b"a"], 2**80) is None
