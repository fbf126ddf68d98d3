"""Focused unit tests of ``pagedkv.optimized``'s own structures: the linked
free queue, the integer-id block pool, the fast hashers and the decode fast
path of the manager. Behaviour shared with the reference is covered by the
scenario and differential suites; these pin the internals those suites
cannot see (link integrity, batch order, byte-identical hashing)."""

from __future__ import annotations

import random
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from pagedkv.optimized import BlockPool, FreeBlockQueue, HybridCoordinator, KVCacheBlocks, KVCacheManager
from pagedkv.optimized.groups.hybrid_search import group_view
from pagedkv.optimized.groups.windowed import reachable_block_mask
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH
from pagedkv.optimized.pool.hasher import make_block_hasher
from pagedkv.spec import (
    BlockRemoved,
    BlockStored,
    ExceedsMaxModelLenError,
    FullAttentionSpec,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTokenCountError,
    InvariantViolation,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManagerLike,
    MMFeature,
    PoolExhaustedError,
    Request,
    UnknownBlockError,
    UnknownRequestError,
)
from pagedkv.spec.hashing import block_extra_keys, hash_block_tokens, need_extra_keys, seed_hash
from pagedkv.spec.protocols import BlockPoolLike, KVCacheBlocksLike
from tests.twins import drive_twins


def config(num_blocks: int = 16, block_size: int = 4, groups: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=(),
        kv_cache_groups=tuple(KVCacheGroupSpec((f"layer{g}",), spec) for g in range(groups)))


# --------------------------------------------------------------- free queue

def test_free_queue_initial_order_and_pop() -> None:
    queue = FreeBlockQueue(8, range(1, 8))
    assert queue.to_list() == [1, 2, 3, 4, 5, 6, 7]
    assert queue.pop_front(3) == [1, 2, 3]
    assert queue.to_list() == [4, 5, 6, 7] and len(queue) == 4
    queue.check()


def test_free_queue_remove_middle_front_back() -> None:
    queue = FreeBlockQueue(8, range(1, 8))
    queue.remove(4)
    queue.remove(1)
    queue.remove(7)
    assert queue.to_list() == [2, 3, 5, 6]
    assert queue.front() == 2
    queue.check()


def test_free_queue_batches_keep_order() -> None:
    queue = FreeBlockQueue(10, [5, 6])
    queue.push_front([3, 1, 2])
    queue.push_back([9, 8])
    assert queue.to_list() == [3, 1, 2, 5, 6, 9, 8]
    queue.check()


def test_free_queue_empty_edges() -> None:
    queue = FreeBlockQueue(4)
    assert queue.front() is None and queue.to_list() == []
    queue.push_front([2])
    queue.push_back([3])
    assert queue.to_list() == [2, 3]
    assert queue.pop_front(2) == [2, 3]
    assert queue.to_list() == [] and len(queue) == 0
    with pytest.raises(IndexError):
        queue.pop_front(1)
    queue.push_back([1])
    assert queue.to_list() == [1]
    queue.check()


@given(st.lists(st.tuples(st.sampled_from("pfbr"), st.integers(0, 5)), max_size=60))
def test_free_queue_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    n = 12
    queue = FreeBlockQueue(n, range(1, n))
    model = list(range(1, n))
    outside = [0]
    for op, k in ops:
        if op == "p":
            k = min(k, len(model))
            popped = queue.pop_front(k)
            assert popped == model[:k]
            model = model[k:]
            outside += popped
        elif op in "fb" and len(outside) > 1:
            batch = outside[1:1 + k]
            outside = [0] + outside[1 + k:]
            if op == "f":
                queue.push_front(batch)
                model = batch + model
            else:
                queue.push_back(batch)
                model = model + batch
        elif op == "r" and model:
            victim = model[k % len(model)]
            queue.remove(victim)
            model.remove(victim)
            outside.append(victim)
        assert queue.to_list() == model
        assert len(queue) == len(model)
    queue.check()


# --------------------------------------------------------------------- pool

def make_request(tokens: list[int], block_size: int = 4, **extra: Any) -> Request:
    return Request("r", tokens, block_hasher=make_block_hasher("sha256", block_size), **extra)


def cache(pool: BlockPool, request: Request, blocks: list[int], num_full: int, *,
          block_size: int = 4, group_id: int = 0, view: list[Any] | None = None,
          mask: list[bool] | None = None) -> None:
    """Cache blocks ``[0, num_full)`` under ``view`` (default: the request's hashes)."""
    pool.cache_full_blocks(request, blocks, block_hashes=request.block_hashes if view is None else view,
                           num_cached_blocks=0, num_full_blocks=num_full, block_size=block_size,
                           group_id=group_id, mask=mask)


def test_pool_allocates_from_front_and_requeues_by_hash() -> None:
    pool = BlockPool(8, True)
    blocks = pool.get_new_blocks(3)
    assert blocks == [1, 2, 3] and pool.get_num_free_blocks() == 4
    request = make_request(list(range(8)))
    cache(pool, request, blocks, 2)
    # tail first: 3 (unhashed) goes to the front, 2 and 1 (hashed) to the back
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue_ids() == [3, 4, 5, 6, 7, 2, 1]
    pool.check_invariants()


def test_pool_touch_removes_from_middle_and_hit_survives() -> None:
    pool = BlockPool(8, True)
    request = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    cache(pool, request, blocks, 2)
    pool.free_blocks(blocks[::-1])
    hit = pool.get_cached_block(request.block_hashes[0], [0])
    assert hit == [1]
    pool.touch(hit)
    assert 1 not in pool.free_queue_ids() and pool.ref_count(1) == 1
    pool.check_invariants()


def test_pool_allocation_evicts_lazily_with_events() -> None:
    pool = BlockPool(3, True, enable_kv_cache_events=True)
    request = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    cache(pool, request, blocks, 2)
    stored = pool.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert stored[0].block_hashes == tuple(request.block_hashes)
    pool.free_blocks(blocks[::-1])
    assert pool.get_new_blocks(1) == [2]  # LRU: block 2 was released first
    assert pool.take_events() == [BlockRemoved(block_hashes=(request.block_hashes[1],), group_idx=0)]
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    pool.check_invariants()


def test_pool_errors_change_nothing() -> None:
    pool = BlockPool(4, True)
    before = pool.snapshot()
    with pytest.raises(PoolExhaustedError):
        pool.get_new_blocks(4)
    with pytest.raises(UnknownBlockError):
        pool.evict_blocks([1, 4])
    with pytest.raises(UnknownBlockError):
        pool.touch([1, -1])
    with pytest.raises(InvariantViolation):
        pool.free_blocks([1])
    blocks = pool.get_new_blocks(1)
    with pytest.raises(InvariantViolation):
        pool.free_blocks(blocks + blocks)  # one reference, released twice
    pool.free_blocks(blocks)
    assert pool.snapshot().free_queue == (1, 2, 3)
    assert before.ref_counts == pool.snapshot().ref_counts


def test_pool_null_block_counters_never_move() -> None:
    pool = BlockPool(4, True)
    pool.touch([0, 0])
    pool.free_blocks([0])
    assert pool.ref_count(0) == 0 and 0 not in pool.free_queue_ids()
    assert pool.null_block == 0


def test_pool_reset_and_usage() -> None:
    pool = BlockPool(5, True, enable_kv_cache_events=True)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == 0.5
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert len(pool.take_events()) == 1
    assert BlockPool(1, True).get_usage() == 0.0


def test_pool_duplicate_blocks_share_a_key_first_wins() -> None:
    pool = BlockPool(6, True)
    request = make_request(list(range(4)))
    first = pool.get_new_blocks(1)
    second = pool.get_new_blocks(1)
    cache(pool, request, first, 1)
    cache(pool, request, second, 1)
    assert pool.get_cached_block(request.block_hashes[0], [0]) == first
    pool.evict_blocks(first)
    assert pool.get_cached_block(request.block_hashes[0], [0]) == second
    pool.check_invariants()


def test_pool_three_identical_blocks_keep_insertion_order() -> None:
    """D-PERF-10: the first holder in the map, later ones apart; evicting
    any keeps the others in insertion order (snapshot and lookups)."""
    pool = BlockPool(8, True)
    request = make_request(list(range(4)))
    key = request.block_hashes[0]
    holders = [pool.get_new_blocks(1) for _ in range(4)]
    for blocks in holders:
        cache(pool, request, blocks, 1)
    ids = [blocks[0] for blocks in holders]
    assert pool.snapshot().cached[0][1] == tuple(ids)
    pool.evict_blocks(holders[1])  # a later holder
    assert pool.snapshot().cached[0][1] == (ids[0], ids[2], ids[3])
    pool.evict_blocks(holders[0])  # the first: the next takes over
    assert pool.get_cached_block(key, [0]) == [ids[2]]
    assert pool.snapshot().cached[0][1] == (ids[2], ids[3])
    pool.recover({b: 1 for b in ids})
    assert pool.snapshot().cached[0][1] == (ids[2], ids[3])
    pool.check_invariants()
    pool.evict_blocks(holders[2] + holders[3])
    assert pool.get_cached_block(key, [0]) is None and pool.snapshot().cached == ()
    pool.check_invariants()


def test_pool_consecutive_cached_blocks_are_evicted_when_reused() -> None:
    """get_new_blocks' slice path takes consecutive ids only when none carries
    a key: cached ones, linked in order, still go through eviction."""
    pool = BlockPool(6, True, enable_kv_cache_events=True)
    request = make_request(list(range(12)))
    blocks = pool.get_new_blocks(3)
    cache(pool, request, blocks, 3)
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.get_new_blocks(2) == [4, 5]  # unhashed, consecutive
    assert pool.get_new_blocks(3) == blocks  # consecutive and linked in order, but hashed
    assert pool.snapshot().cached == ()
    assert [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)] == [
        (key,) for key in request.block_hashes[:3]]
    assert pool.ref_counts[1:] == [1] * 5 and pool.get_num_free_blocks() == 0
    pool.check_invariants()


@pytest.mark.parametrize("order", ["consecutive", "scattered"])
def test_pool_bulk_caching_falls_back_to_the_per_block_rule(order: str) -> None:
    """A run whose key repeats, or whose blocks are hashed already or null,
    is keyed exactly as block by block (first holder in the map, later ones
    apart, skipped blocks untouched), whether its ids are consecutive or not."""
    pool = BlockPool(10, True, enable_kv_cache_events=True)
    request = make_request(list(range(12)))
    keys = request.block_hashes
    fresh = pool.get_new_blocks(6)
    run = fresh[:3] if order == "consecutive" else [fresh[2], fresh[0], fresh[4]]
    cache(pool, request, run, 3, view=[keys[0], keys[1], keys[0]])  # a key twice in the run
    assert pool.snapshot().cached == tuple(sorted(
        [(keys[0] + bytes(4), (run[0], run[2])), (keys[1] + bytes(4), (run[1],))]))
    events = pool.take_events()
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [(keys[0], keys[1], keys[0])]
    other = [fresh[5], run[1], 0] if order == "scattered" else [fresh[3], fresh[4], fresh[5]]
    cache(pool, request, other, 3, view=[keys[2], keys[1], keys[2]])
    pool.check_invariants()
    held = pool.snapshot().cached
    if order == "scattered":  # a hashed block keeps its key; the null block gets none
        assert (keys[1] + bytes(4), (run[1],)) in held and (keys[2] + bytes(4), (other[0],)) in held
    else:  # a key cached already: the new block is a later holder
        assert (keys[1] + bytes(4), (run[1], other[1])) in held
        assert (keys[2] + bytes(4), (other[0], other[2])) in held


@pytest.mark.parametrize("corruption", ["later holders without a first", "first listed again", "empty list"])
def test_pool_invariants_catch_a_broken_duplicate_map(corruption: str) -> None:
    """The side map of later holders (D-PERF-10) is checked as part of CACHE-1."""
    pool = BlockPool(6, True)
    request = make_request(list(range(4)))
    blocks = pool.get_new_blocks(1)
    cache(pool, request, blocks, 1)
    pool.check_invariants()
    key = request.block_hashes[0]
    dups = pool.dup_by_group[0]
    if corruption == "later holders without a first":
        dups[b"\7" * len(key)] = [blocks[0]]
    elif corruption == "first listed again":
        dups[key] = [blocks[0]]
    else:
        dups[key] = []
    with pytest.raises(InvariantViolation, match="^CACHE-1"):
        pool.check_invariants()


def test_pool_get_cached_block_refuses_a_group_outside_the_pool() -> None:
    pool = BlockPool(8, True, num_groups=2)
    with pytest.raises(InvalidArgumentError):
        pool.get_cached_block(b"k" * 32, [2, 0])
    assert pool.get_cached_block(b"k" * 32, [0, 1]) is None


def test_pool_caching_disabled_never_hashes() -> None:
    pool = BlockPool(4, False)
    request = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    cache(pool, request, blocks, 2)
    assert pool.snapshot().block_hashes == (None,) * 4
    pool.check_invariants()


# ------------------------------------------------------------------ hashing

@pytest.mark.parametrize("hash_fn", ["sha256", "sha256_cbor", "xxh3_128", "xxhash"])
@pytest.mark.parametrize("extras", [False, True])
def test_hasher_is_byte_identical(hash_fn: str, extras: bool) -> None:
    rng = random.Random(hash_fn)
    tokens = [rng.randrange(2**32) for _ in range(50)]
    kwargs: dict[str, Any] = {}
    if extras:
        kwargs = dict(lora_name="adapter", cache_salt="salt",
                      mm_features=(MMFeature("img", 3, 6), MMFeature("vid", 9, 2)))
    hasher = make_block_hasher(hash_fn, 4, "seed")
    request = Request("r", tokens[:13], block_hasher=hasher, **kwargs)
    for token in tokens[13:]:
        request.append_output_token_ids(token)
    request.append_output_token_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])
    canonical = {"xxhash": "xxh3_128"}.get(hash_fn, hash_fn)
    parent = seed_hash(canonical, "seed")  # type: ignore[arg-type]
    expected = []
    for start in range(0, request.num_tokens - 3, 4):
        keys = (block_extra_keys(request, start, start + 4, 0)[0]
                if need_extra_keys(request) else None)
        parent = hash_block_tokens(canonical, parent,  # type: ignore[arg-type]
                                   request.all_token_ids[start:start + 4], keys)
        expected.append(parent)
    assert request.block_hashes == expected


def test_xxh3_rejects_tokens_beyond_u32() -> None:
    with pytest.raises(InvalidArgumentError):
        Request("r", [2**32, 1, 2, 3], block_hasher=make_block_hasher("xxh3_128", 4))


# ------------------------------------------------------------------ manager

def test_manager_satisfies_the_protocols() -> None:
    manager: KVCacheManagerLike = KVCacheManager(config(), 64)
    pool: BlockPoolLike = manager.block_pool
    blocks: KVCacheBlocksLike = manager.get_computed_blocks(manager.make_request("a", [1]))[0]
    assert pool.num_blocks == 16 and blocks.get_block_ids() == ([],)


def test_decode_fast_path_returns_shared_empty_and_changes_nothing() -> None:
    manager = KVCacheManager(config(), 64)
    request = manager.make_request("a", [1, 2, 3, 4, 5, 6])
    first = manager.allocate_slots(request, 6)
    assert first is not None and first.get_block_ids() == ([1, 2],)
    request.num_computed_tokens = 6
    request.append_output_token_ids(7)
    before = manager.snapshot()
    again = manager.allocate_slots(request, 1)
    assert again is manager.allocate_slots(request, 1)  # the shared empty result
    assert again is not None and again.get_block_ids() == ([],)
    assert manager.snapshot() == before
    # The token that fills block 2 is cached by the slow path.
    request.num_computed_tokens = 7
    request.append_output_token_ids(8)
    manager.allocate_slots(request, 1)
    assert manager.snapshot().requests[0].num_cached_blocks == (2,)
    manager.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_known_single_group_step_equals_the_general_path(caching: bool, seed: int) -> None:
    """The coordinator's decode step (one full-attention group) against the
    general path on a twin manager whose fast path is switched off: same
    result, state, events and errors, through eviction (a small pool),
    refusals and malformed steps."""
    rng = random.Random(seed)
    fast, general = (KVCacheManager(config(num_blocks=12), 40, enable_caching=caching, log_stats=True,
                                    enable_kv_cache_events=True) for _ in range(2))
    decode_step = fast.coordinator.decode_step
    assert decode_step is not None
    general.coordinator.decode_step = None

    def fast_step(manager: KVCacheManager, request: Request, num_new: int, delay: bool) -> Any:
        result = decode_step(request, num_new, delay)
        return (manager.allocate_slots(request, num_new, delay_cache_blocks=delay)
                if result is TAKE_GENERAL_PATH else result)

    changed = drive_twins(fast, general, rng, steps=300, vocab=4, max_prompt=12, num_new=range(1, 7),
                          fast_step=fast_step)
    assert changed >= 50


def test_known_single_group_step_hands_errors_to_the_general_path() -> None:
    manager = KVCacheManager(config(), 12, enable_kv_cache_events=True)
    request = manager.make_request("a", [1, 2, 3, 4, 5, 6])
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    manager.take_events()
    before = manager.snapshot()
    with pytest.raises(ExceedsMaxModelLenError):
        manager.allocate_slots(request, 7)  # 13 > max_model_len 12
    request.num_computed_tokens = 6.0  # type: ignore[assignment]
    with pytest.raises(InvalidTokenCountError):
        manager.allocate_slots(request, 3)
    assert manager.snapshot() == before and manager.take_events() == []


def test_prefix_hit_and_free_round_trip() -> None:
    manager = KVCacheManager(config(), 64, log_stats=True)
    a = manager.make_request("a", list(range(10)))
    assert manager.allocate_slots(a, 10) is not None
    manager.free(a)
    b = manager.make_request("b", list(range(9)) + [99])
    hit, num_tokens = manager.get_computed_blocks(b)
    assert hit.get_block_ids() == ([1, 2],) and num_tokens == 8
    assert hit.get_unhashed_block_ids() == []
    new = manager.allocate_slots(b, 2, 8, hit)
    assert new is not None and manager.get_block_ids("b")[0][:2] == [1, 2]
    assert manager.get_num_common_prefix_blocks("b") == [3]
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and stats.hits == 8
    manager.check_invariants()
    manager.free(b)
    with pytest.raises(UnknownRequestError):
        manager.free(b)
    manager.free(b, missing_ok=True)
    assert manager.reset_prefix_cache() is True


def test_manager_config_errors() -> None:
    # Several groups with caching: the hybrid coordinator.
    assert isinstance(KVCacheManager(config(groups=2), 64).coordinator, HybridCoordinator)
    with pytest.raises(InvalidConfigError):
        KVCacheManager(config(), 0)
    with pytest.raises(InvalidConfigError):
        KVCacheManager(config(), 64, hash_block_size=3)  # must divide the block size
    with pytest.raises(InvalidConfigError):
        KVCacheManager(config(), 64, retention_interval=6)  # not a multiple of the alignment
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(config(), 64, hash_fn="md5")
    manager = KVCacheManager(config(groups=0), 64, enable_caching=False)
    request = manager.make_request("a", [1, 2, 3])
    result = manager.allocate_slots(request, 3)
    assert result is not None and result.get_block_ids() == ()
    assert manager.get_num_common_prefix_blocks("a") == []
    # Zero groups with caching on: nothing is hashed or hit.
    cached = KVCacheManager(config(groups=0), 64)
    request = cached.make_request("a", [1, 2, 3])
    assert cached.get_computed_blocks(request)[1] == 0
    assert cached.allocate_slots(request, 3) is not None
    cached.cache_blocks(request, 3)
    cached.free(request)


def test_kv_cache_blocks_value_semantics() -> None:
    hashes: list[Any] = [None] * 8
    left = KVCacheBlocks(([1, 2],), hashes)
    right = KVCacheBlocks(([3],), hashes)
    total = left + right
    assert total.get_block_ids() == ([1, 2, 3],) and left.get_block_ids() == ([1, 2],)
    assert total.new_empty().get_block_ids() == ([],)
    ids = total.get_block_ids()
    ids[0].append(7)
    assert total.get_block_ids() == ([1, 2, 3],)  # copies handed out
    with pytest.raises(InvalidArgumentError):
        KVCacheBlocks(([1], [2]), hashes).get_unhashed_block_ids()


def test_check_invariants_names_the_broken_invariant() -> None:
    pool = BlockPool(4, True)
    pool.check_invariants()
    pool.ref_counts[2] = 1  # in the free queue yet referenced
    with pytest.raises(InvariantViolation, match="^POOL-2"):
        pool.check_invariants()
    manager = KVCacheManager(config(), 64)
    request = manager.make_request("a", [1, 2, 3, 4, 5])
    manager.allocate_slots(request, 5)
    manager.block_pool.ref_counts[1] += 1
    with pytest.raises(InvariantViolation, match="^REQ-1"):
        manager.check_invariants()


def test_stale_hit_is_refused_before_any_change() -> None:
    manager = KVCacheManager(config(num_blocks=4), 64)
    a = manager.make_request("a", list(range(9)))
    manager.allocate_slots(a, 9)
    manager.free(a)
    b = manager.make_request("b", list(range(9)))
    hit, num_tokens = manager.get_computed_blocks(b)
    assert num_tokens == 8
    manager.evict_blocks(hit.get_block_ids()[0][1:])
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError, match="stale"):
        manager.allocate_slots(b, 1, num_tokens, hit)
    assert manager.snapshot() == before


# ------------------------------------------------------------------- hybrid

@pytest.mark.parametrize("mode", ["per_call", "per_run"])
def test_pool_events_under_a_view_per_call_or_per_run(mode: str) -> None:
    pool = BlockPool(8, True, enable_kv_cache_events=True, block_stored_events=mode)
    request = Request("r", list(range(16)), block_hasher=make_block_hasher("sha256", 2))
    view = group_view(request.block_hashes, 2)
    blocks = pool.get_new_blocks(4)
    cache(pool, request, blocks, 4, view=view, mask=[True, False, True, True])
    events = pool.take_events()
    shape = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events if isinstance(e, BlockStored)]
    if mode == "per_call":  # vLLM's: the keyed hashes, the whole range's tokens (D-EVT-15)
        assert shape == [((view[0], view[2], view[3]), None, tuple(range(16)))]
    else:
        assert shape == [((view[0],), None, tuple(range(4))), ((view[2], view[3]), view[1], tuple(range(8, 16)))]
    assert pool.cache_key(blocks[1]) is None
    pool.check_invariants()


def test_reserved_blocks_do_not_block_a_reset() -> None:
    pool = BlockPool(6, True)
    assert pool.reserve(2) == [1, 2]
    assert pool.reset_prefix_cache() is True
    blocks = pool.get_new_blocks(1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True


@given(st.integers(0, 12), st.integers(0, 12), st.sampled_from([1, 2, 4]), st.sampled_from([4, 8]),
       st.integers(1, 3), st.sampled_from([None, 0, 8, 16]), st.lists(st.integers(0, 60), max_size=3))
def test_reachable_block_mask_matches_the_reference_rule(
        start: int, width: int, block_size: int, alignment: int, need: int,
        retention: int | None, boundaries: list[int]) -> None:
    from pagedkv.reference.features import sparse_retention as rules

    if alignment % block_size or (retention is not None and retention % alignment):
        return
    for shift in (0, 1):
        assert reachable_block_mask(start, start + width, block_size, alignment, need, shift, retention,
                                    boundaries) == rules.reachable_block_mask(
            start, start + width, block_size, alignment, need, shift, retention, tuple(boundaries))


@given(st.data())
def test_hybrid_search_equals_the_brute_force(data: st.DataObject) -> None:
    """The fixed-point search against the reference's definition, on random
    cached/uncached patterns (evictions), windows, chunks, block sizes, EAGLE."""
    import pagedkv.reference as reference
    from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec
    from pagedkv.spec.mamba_spec import MambaSpec

    specs: list[Any] = []
    for _ in range(data.draw(st.integers(1, 4))):
        size = data.draw(st.sampled_from([2, 4]))
        kind = data.draw(st.sampled_from(["full", "swa", "chunk", "mamba"]))
        if kind == "full":
            specs.append(FullAttentionSpec(size, 1, 8, "float16"))
        elif kind == "swa":
            specs.append(SlidingWindowSpec(size, 1, 8, "float16", sliding_window=data.draw(st.integers(1, 12))))
        elif kind == "chunk":
            specs.append(ChunkedLocalAttentionSpec(size, 1, 8, "float16",
                                                   attention_chunk_size=size * data.draw(st.integers(1, 3))))
        else:
            specs.append(MambaSpec(size, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="all"))
    groups = tuple(KVCacheGroupSpec((f"l{i}",), spec) for i, spec in enumerate(specs))
    kv_config = KVCacheConfig(400, (), groups)
    use_eagle = data.draw(st.booleans())
    managers = [module.KVCacheManager(kv_config, 128, use_eagle=use_eagle)
                for module in (reference, __import__("pagedkv.optimized").optimized)]
    tokens = [data.draw(st.integers(0, 1)) for _ in range(data.draw(st.integers(8, 60)))]
    for manager in managers:
        first = manager.make_request("a", tokens)
        assert manager.allocate_slots(first, len(tokens)) is not None
        manager.free(first)
    evict = data.draw(st.lists(st.integers(1, 120), max_size=30))
    for manager in managers:
        manager.evict_blocks(evict)
    probe = tokens + [data.draw(st.integers(0, 1)) for _ in range(data.draw(st.integers(1, 8)))]
    results = [manager.get_computed_blocks(manager.make_request("b", probe)) for manager in managers]
    assert results[0][1] == results[1][1]
    assert results[0][0].get_block_ids() == results[1][0].get_block_ids()


def test_free_batches_front_and_back_in_release_order() -> None:
    pool = BlockPool(10, True)
    request = Request("r", list(range(6)), block_hasher=make_block_hasher("sha256", 1))
    blocks = pool.get_new_blocks(6)
    cache(pool, request, blocks, 6, block_size=1, mask=[True, False, True, False, True, False])
    pool.free_blocks(reversed(blocks))
    # unhashed 6, 4, 2 to the front as one batch; hashed 5, 3, 1 to the back
    assert pool.free_queue_ids() == [6, 4, 2, 7, 8, 9, 5, 3, 1]
    pool.check_invariants()


def _hybrid_config(kinds: tuple[str, ...], num_blocks: int = 96, block_size: int = 4) -> KVCacheConfig:
    from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, KVCacheSpec, SlidingWindowSpec
    from pagedkv.spec.mamba_spec import MambaSpec

    def spec(kind: str) -> KVCacheSpec:
        if kind == "full":
            return FullAttentionSpec(block_size, 1, 1, "float16")
        if kind == "sliding":
            return SlidingWindowSpec(block_size, 1, 1, "float16", sliding_window=6)
        if kind == "chunked":
            return ChunkedLocalAttentionSpec(block_size, 1, 1, "float16", attention_chunk_size=8)
        mode, _, spec_blocks = kind.partition(":")
        return MambaSpec(block_size, shapes=((2,),), dtypes=("float16",), mamba_cache_mode=mode[6:],
                         num_speculative_blocks=int(spec_blocks or 0))

    return KVCacheConfig(num_blocks, (), tuple(
        KVCacheGroupSpec((f"layer.{index}",), spec(kind)) for index, kind in enumerate(kinds)))


@pytest.mark.parametrize("kinds", [
    ("sliding", "sliding", "full"),
    ("full", "chunked"),
    ("full", "mamba-all"),
    ("full", "mamba-all:1"),
    ("sliding", "mamba-none"),
    ("full", "mamba-align"),
    ("full", "mamba-align:1"),
])
@pytest.mark.parametrize("caching", [True, False])
def test_multi_group_decode_fast_path_is_exactly_a_no_op(kinds: tuple[str, ...], caching: bool) -> None:
    """Whenever decode.is_noop_decode says a step changes nothing, the
    general path run on the same state changes nothing and returns the empty
    result; and the fast path does take most decode steps. (The steps it
    says change something the installed step settles through its filling
    branch, tests/test_fill_path.py.)"""
    from pagedkv.optimized.paths.decode import decode_probes, is_noop_decode

    rng = random.Random(repr((kinds, caching)))
    manager = KVCacheManager(_hybrid_config(kinds), 256, enable_caching=caching)
    probes = decode_probes(manager.coordinator.managers)
    assert probes is not None and manager.coordinator.decode_step is not None
    request = manager.make_request("a", [rng.randrange(50) for _ in range(5)])
    assert manager.allocate_slots(request, 5) is not None
    request.num_computed_tokens = 5
    taken = 0
    for step in range(60):
        request.append_output_token_ids(rng.randrange(50))
        delay = rng.random() < 0.2
        computed = request.num_computed_tokens
        cache_tokens = min(computed + 1, request.num_tokens) if caching and not delay else -1
        noop = is_noop_decode(probes, "a", computed, computed + 1, cache_tokens)
        # The installed step inlines is_noop_decode: the same answer, the
        # shared empty result with nothing changed (else it fills: the step is done).
        before = manager.snapshot()
        fast = manager.coordinator.decode_step(request, 1, delay)
        assert fast is not None and fast is not TAKE_GENERAL_PATH, (step, kinds)
        if noop:
            assert fast is manager.coordinator.empty_blocks, (step, kinds)
            assert manager.snapshot() == before, (step, kinds)
            taken += 1
            decode_step, manager.coordinator.decode_step = manager.coordinator.decode_step, None
            result = manager.allocate_slots(request, 1, delay_cache_blocks=delay)  # the general path
            manager.coordinator.decode_step = decode_step
            assert result is not None and not any(result.get_block_ids()), (step, kinds)
            assert manager.snapshot() == before, (step, kinds)
        request.num_computed_tokens += 1
        manager.check_invariants()
    assert taken >= 10  # block size 4: a block fills, is needed or leaves a window often


def test_decode_probes_leave_uncovered_types_to_the_general_path() -> None:
    from pagedkv.optimized.paths.decode import decode_probes
    from pagedkv.spec.kv_cache_spec import CrossAttentionSpec

    config = _hybrid_config(("full",))
    config = KVCacheConfig(config.num_blocks, (), config.kv_cache_groups + (
        KVCacheGroupSpec(("layer.cross",), CrossAttentionSpec(4, 1, 8, "float16")),))
    manager = KVCacheManager(config, 256)
    assert decode_probes(manager.coordinator.managers) is None
    assert manager.coordinator.decode_step is None


def test_group_id_is_minus_one_exactly_when_unhashed() -> None:
    pool = BlockPool(8, True, num_groups=2)
    request = make_request(list(range(12)))
    blocks = pool.get_new_blocks(3)
    assert pool.block_group_ids[1:4] == [-1, -1, -1]
    cache(pool, request, blocks, 2, group_id=1)
    assert pool.block_group_ids[1:4] == [1, 1, -1]
    pool.evict_blocks([blocks[0]])
    assert pool.block_group_ids[1:4] == [-1, 1, -1]
    pool.free_blocks(blocks)
    # In the caller's order: the unhashed ones to the front in release order, the hashed one to the back.
    assert pool.free_queue_ids()[:2] == [blocks[0], blocks[2]] and pool.free_queue_ids()[-1] == blocks[1]
    assert pool.reset_prefix_cache() and pool.block_group_ids == [-1] * 8
    pool.check_invariants()


@pytest.mark.parametrize("implementation", ["reference", "optimized"])
def test_both_pools_share_a_constructor_and_its_errors(implementation: str) -> None:
    """Both pools: ``BlockPool(num_blocks, enable_caching, *,
    enable_kv_cache_events=False, num_groups=1)``, InvalidConfigError for a
    malformed size (spec/operations.md, "Construction"), InvalidArgumentError
    for a malformed ``get_new_blocks`` count, and a double release of a block
    referenced once refused with no change (POOL-3)."""
    import importlib

    pool_class: Any = importlib.import_module(f"pagedkv.{implementation}").BlockPool
    for num_blocks in (0, 2.0, "3"):
        with pytest.raises(InvalidConfigError, match="num_blocks"):
            pool_class(num_blocks, True)
    with pytest.raises(InvalidConfigError, match="num_groups"):
        pool_class(4, True, num_groups=-1)
    pool = pool_class(4, True, enable_kv_cache_events=True, num_groups=2)
    for count in (-1, 1.0, "1"):
        with pytest.raises(InvalidArgumentError, match="num_blocks"):
            pool.get_new_blocks(count)
    blocks = pool.get_new_blocks(1)
    before = pool.snapshot()
    with pytest.raises(InvariantViolation, match="^POOL-3"):
        pool.free_blocks(blocks + blocks)
    assert pool.snapshot() == before
    pool.free_blocks(blocks)
    assert pool.snapshot().ref_counts == (0, 0, 0, 0)
