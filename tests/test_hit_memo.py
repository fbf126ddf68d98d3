"""The pool's lookup memo (``optimized/pool/hit_memo.py``, D-PERF-44).

A full-attention lookup leaves ``(map_epoch, hashes, hit)`` on the pool and
the admission step admits that very hit without probing the map again. The
memo is only sound while ``map_epoch`` moves on every change to what a map
serves: these tests change the map each way it can change between a lookup
and the admission (an eviction in C or in Python, a reset, a recovery) and
demand that the stale hit is refused exactly as the general path refuses
it, and that a fresh hit still goes through. ``same_prefix`` is held to
identity, not equality.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.optimized import KVCacheManager
from pagedkv.optimized.native import NATIVE
from pagedkv.optimized.pool import hit_memo
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request
from pagedkv.spec.errors import InvalidArgumentError, UnknownBlockError

BLOCK = 4


def _manager(num_blocks: int, events: bool = False) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(),
                           kv_cache_groups=(KVCacheGroupSpec(("layer0",), spec),))
    return KVCacheManager(config, 64, enable_kv_cache_events=events)


def _prefill(manager: KVCacheManager, request: Request) -> None:
    hit, tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - tokens, tokens, hit) is not None


def _cached_then_looked_up(manager: KVCacheManager) -> tuple[Request, Any, int]:
    """A prompt of 3 full blocks + 1 token cached and freed, then a second
    request's lookup of it: the memo now vouches for a 3-block hit."""
    prompt = list(range(1, 3 * BLOCK + 2))
    first = manager.make_request("first", prompt)
    _prefill(manager, first)
    manager.free(first)
    second = manager.make_request("second", prompt)
    hit, tokens = manager.get_computed_blocks(second)
    assert tokens == 3 * BLOCK
    assert hit_memo.vouches(manager.block_pool, second.block_hashes, hit.blocks[0])
    return second, hit, tokens


def _stale_is_refused(manager: KVCacheManager, request: Request, hit: Any, tokens: int) -> None:
    assert not hit_memo.vouches(manager.block_pool, request.block_hashes, hit.blocks[0])
    with pytest.raises(InvalidArgumentError, match="stale|evicted|cache map"):
        manager.allocate_slots(request, request.num_tokens - tokens, tokens, hit)
    manager.check_invariants()


@pytest.mark.parametrize("events", [False, True])
def test_a_fresh_hit_is_vouched_for_and_admitted(events: bool) -> None:
    manager = _manager(16, events)
    request, hit, tokens = _cached_then_looked_up(manager)
    blocks = list(hit.blocks[0])
    assert manager.allocate_slots(request, request.num_tokens - tokens, tokens, hit) is not None
    assert manager.get_block_ids(request.request_id)[0][:3] == blocks
    manager.check_invariants()


@pytest.mark.parametrize("events", [False, True])
def test_an_eviction_between_lookup_and_admission_is_seen(events: bool) -> None:
    # 1 null + 3 cached free blocks + 1 free: the other request's 4 blocks
    # evict the hit's blocks (in C when events are off, through _evict when on).
    manager = _manager(6, events)
    request, hit, tokens = _cached_then_looked_up(manager)
    other = manager.make_request("other", list(range(100, 100 + 4 * BLOCK)))
    assert manager.allocate_slots(other, 4 * BLOCK) is not None
    _stale_is_refused(manager, request, hit, tokens)


def test_a_reset_between_lookup_and_admission_is_seen() -> None:
    manager = _manager(16)
    request, hit, tokens = _cached_then_looked_up(manager)
    assert manager.reset_prefix_cache()
    _stale_is_refused(manager, request, hit, tokens)


def test_a_recovery_between_lookup_and_admission_is_seen() -> None:
    manager = _manager(16)
    request, hit, tokens = _cached_then_looked_up(manager)
    before = manager.block_pool.map_epoch
    manager.block_pool.recover({})  # the maps are rebuilt from the blocks' own keys
    assert manager.block_pool.map_epoch != before
    assert not hit_memo.vouches(manager.block_pool, request.block_hashes, hit.blocks[0])
    # Nothing was lost, so the probe still admits it (the memo only saves the probe).
    assert manager.allocate_slots(request, request.num_tokens - tokens, tokens, hit) is not None
    manager.check_invariants()


def test_an_equal_but_not_identical_hit_is_probed_not_vouched() -> None:
    manager = _manager(16)
    request, hit, tokens = _cached_then_looked_up(manager)
    pool = manager.block_pool
    copied: Any = [float(block) for block in hit.blocks[0]]  # equal ids, other objects (not ints)
    assert copied == hit.blocks[0]
    assert not hit_memo.vouches(pool, request.block_hashes, copied)
    assert not hit_memo.vouches(pool, request.block_hashes, [True, *hit.blocks[0][1:]])
    assert not hit_memo.vouches(pool, request.block_hashes, hit.blocks[0][:2])
    rebuilt: Any = [bytes(bytearray(h)) for h in request.block_hashes]  # equal keys, other objects
    assert not hit_memo.vouches(pool, rebuilt, hit.blocks[0])
    assert not hit_memo.vouches(pool, request.block_hashes[:2], hit.blocks[0])


def test_the_admission_refuses_an_equal_but_not_identical_hit() -> None:
    # The admission step tests the memo inline (admit_path): equal ids that are
    # other objects (floats) must be probed, and refused as the general path refuses them.
    manager = _manager(16)
    request, hit, tokens = _cached_then_looked_up(manager)
    hit.blocks[0][:] = [float(block) for block in hit.blocks[0]]  # the memo keeps its own copy
    with pytest.raises((InvalidArgumentError, UnknownBlockError)):
        manager.allocate_slots(request, request.num_tokens - tokens, tokens, hit)
    assert request.request_id not in manager.coordinator.requests
    manager.check_invariants()


def test_same_prefix_compares_identity() -> None:
    same = hit_memo.same_prefix
    a, b = object(), object()
    big, also_big = 10**30, int(str(10**30))
    assert same([a, b, 3], [a, b]) is True
    assert same((a, b), [a, b]) is True
    assert same([a, b], []) is True
    assert same([a], [a, b]) is False  # shorter
    assert same([b, a], [a, b]) is False
    assert same([big], [also_big]) is False  # equal, not identical


# The scan memo (D-PERF-46): a full-attention group's hit blocks reuse the
# prefix scan its longest_hit just made, only for those very hashes and while
# the epoch stands.

def _two_cached_prompts(manager: KVCacheManager) -> tuple[Request, Request]:
    prompts = [list(range(1, 3 * BLOCK + 2)), list(range(200, 200 + 3 * BLOCK + 1))]
    made = []
    for number, prompt in enumerate(prompts):
        request = manager.make_request(f"cached{number}", prompt)
        _prefill(manager, request)
        manager.free(request)
        made.append(manager.make_request(f"probe{number}", prompt))
    return made[0], made[1]


def test_the_scan_memo_serves_only_the_hashes_it_scanned() -> None:
    manager = _manager(16)
    first, second = _two_cached_prompts(manager)
    group = manager.coordinator.managers[0]
    assert group.longest_hit(first.block_hashes, 3 * BLOCK, 3 * BLOCK) == 3 * BLOCK
    expected = [manager.block_pool.cached_by_group[0][key] for key in second.block_hashes[:3]]
    assert group.hit_blocks(second.block_hashes, 3 * BLOCK) == expected  # not first's blocks
    copied: Any = [bytes(bytearray(key)) for key in first.block_hashes]
    assert group.hit_blocks(copied, 3 * BLOCK) == group.hit_blocks(first.block_hashes, 3 * BLOCK)


def test_the_scan_memo_ends_with_the_epoch() -> None:
    manager = _manager(6)  # 1 null + 3 cached free blocks + 1 free, as above
    request, _, _ = _cached_then_looked_up(manager)
    group = manager.coordinator.managers[0]
    assert group.longest_hit(request.block_hashes, 3 * BLOCK, 3 * BLOCK) == 3 * BLOCK
    other = manager.make_request("other", list(range(100, 100 + 4 * BLOCK)))
    assert manager.allocate_slots(other, 4 * BLOCK) is not None  # evicts the scanned blocks
    with pytest.raises(KeyError):
        group.hit_blocks(request.block_hashes, 3 * BLOCK)  # the map no longer serves them


@pytest.mark.parametrize("events", [False, True])
def test_the_epoch_moves_on_evictions_only(events: bool) -> None:
    # Taking fresh blocks leaves the epoch; taking keyed ones moves it (once
    # per take in C with events off, once per key through _evict with them on
    # or in the pure build).
    manager = _manager(6, events)
    request, _, _ = _cached_then_looked_up(manager)  # blocks 1-3 keyed and free
    pool = manager.block_pool
    start = pool.map_epoch
    assert pool.get_new_blocks(1) == [4]  # the partial block of the first prompt: no key
    assert pool.map_epoch == start
    taken = pool.get_new_blocks(4)  # the rest: block 5 (fresh) and the three keyed ones
    assert sorted(taken) == [1, 2, 3, 5] and all(pool.cache_key(b) is None for b in taken)
    assert pool.map_epoch == start + (3 if events or NATIVE is None else 1)
    assert not hit_memo.vouches(pool, request.block_hashes, [1, 2, 3])
