"""Concrete behaviours the seeds spell out, one suite over every implementation.

Each test builds a tiny pool (block size 4) and checks exact block ids,
ref counts, hashes, queue order and events, so it reads as a worked example
of spec/operations.md.
"""

from __future__ import annotations

import hashlib
import pickle
from types import ModuleType
from typing import Any

import pytest

from pagedkv.spec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExceedsMaxModelLenError,
    FullAttentionSpec,
    InvalidTokenCountError,
    KVCacheConfig,
    KVCacheGroupSpec,
    MMFeature,
    PrefixCachingMetrics,
    UnknownBlockError,
    UnknownRequestError,
)
from pagedkv.spec.hashing import seed_hash

BLOCK = 4


def make(impl: ModuleType, num_blocks: int = 12, **kwargs: Any) -> Any:
    config = KVCacheConfig(num_blocks, (), (KVCacheGroupSpec(("layer.0",), FullAttentionSpec(BLOCK, 1, 8, "float16")),))
    return impl.KVCacheManager(config, 64, **kwargs)


def admit(manager: Any, request: Any) -> Any:
    """What a scheduler does for a new request: hit lookup, then one allocation."""
    hit, num_hit = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
    if blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return blocks


def ref_counts(manager: Any) -> tuple[int, ...]:
    return tuple(manager.snapshot().pool.ref_counts)


def free_queue(manager: Any) -> tuple[int, ...]:
    return tuple(manager.snapshot().pool.free_queue)


def test_eviction_order_after_two_requests_sharing_a_prefix_are_freed(impl: ModuleType) -> None:
    manager = make(impl)
    a = manager.make_request("a", list(range(10)))            # blocks [1, 2] full, [3] partial
    b = manager.make_request("b", list(range(8)) + [7, 7, 7])  # shares blocks 1, 2; own partial block
    assert admit(manager, a).get_block_ids() == ([1, 2, 3],)
    assert admit(manager, b).get_block_ids() == ([4],)
    assert manager.get_block_ids("b") == ([1, 2, 4],)
    manager.free(a)
    manager.free(b)
    # Unhashed partial blocks go to the front (reused first); the shared
    # cached blocks go to the back, tail first, so the prefix root is evicted last.
    assert free_queue(manager) == (4, 3, 5, 6, 7, 8, 9, 10, 11, 2, 1)


def test_hit_revives_free_cached_blocks(impl: ModuleType) -> None:
    manager = make(impl)
    a = manager.make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    assert ref_counts(manager)[1:3] == (0, 0)
    b = manager.make_request("b", list(range(8)) + [5])
    hit, num_hit = manager.get_computed_blocks(b)
    assert (hit.get_block_ids(), num_hit) == (([1, 2],), 8)
    assert 1 in free_queue(manager)  # a lookup reserves nothing
    manager.allocate_slots(b, 1, num_hit, hit)
    assert ref_counts(manager)[1:3] == (1, 1)
    assert 1 not in free_queue(manager) and 2 not in free_queue(manager)


def test_refused_allocation_leaves_hit_blocks_untouched(impl: ModuleType) -> None:
    manager = make(impl, num_blocks=5)  # 4 usable blocks
    a = manager.make_request("a", list(range(9)))
    admit(manager, a)       # holds 1, 2, 3
    manager.free(a)
    b = manager.make_request("b", list(range(8)) + list(range(100, 120)))
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    before = manager.snapshot()
    assert manager.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is None
    assert manager.snapshot() == before
    with pytest.raises(UnknownRequestError):
        manager.get_block_ids("b")


def test_last_prompt_token_is_always_recomputed(impl: ModuleType) -> None:
    manager = make(impl)
    a = manager.make_request("a", list(range(8)))   # exactly two full blocks
    admit(manager, a)
    b = manager.make_request("b", list(range(8)))
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4 and hit.get_block_ids() == ([1],)  # block 2 recomputed for the last token


def test_decode_fills_a_block_then_hashes_it(impl: ModuleType) -> None:
    manager = make(impl, enable_kv_cache_events=True)
    a = manager.make_request("a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    assert len(manager.take_events()) == 1  # block 1 cached
    for token in (7, 8):
        a.append_output_token_ids(token)
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert manager.get_block_ids("a") == ([1, 2],)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == (5, 6, 7, 8) and stored.parent_block_hash == a.block_hashes[0]
    assert manager.snapshot().pool.block_hashes[2] is not None


def test_reused_block_loses_its_old_hash(impl: ModuleType) -> None:
    manager = make(impl, num_blocks=3, enable_kv_cache_events=True)  # blocks 1 and 2
    a = manager.make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    manager.take_events()
    b = manager.make_request("b", [9] * 8)
    admit(manager, b)
    events = manager.take_events()
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    assert [event.block_hashes for event in removed] == [(a.block_hashes[1],), (a.block_hashes[0],)]
    c = manager.make_request("c", list(range(8)) + [1])
    assert manager.get_computed_blocks(c)[1] == 0


def test_cache_salt_isolates_identical_prompts(impl: ModuleType) -> None:
    manager = make(impl)
    plain = manager.make_request("a", list(range(12)))
    salted = manager.make_request("b", list(range(12)), cache_salt="tenant-1")
    assert plain.block_hashes[0] != salted.block_hashes[0]
    admit(manager, plain)
    assert manager.get_computed_blocks(salted)[1] == 0
    again = manager.make_request("c", list(range(12)), cache_salt="tenant-1")
    admit(manager, salted)
    assert manager.get_computed_blocks(again)[1] == 8


def test_lora_and_multimodal_keys_change_hashes(impl: ModuleType) -> None:
    manager = make(impl)
    base = manager.make_request("a", list(range(8)))
    lora = manager.make_request("b", list(range(8)), lora_name="adapter")
    image = manager.make_request("c", list(range(8)), mm_features=(MMFeature("img-1", 5, 2),))
    other_image = manager.make_request("d", list(range(8)), mm_features=(MMFeature("img-2", 5, 2),))
    assert base.block_hashes[0] != lora.block_hashes[0]
    # The image sits in block 1 only: block 0 hashes as plain text.
    assert image.block_hashes[0] == base.block_hashes[0]
    assert len({base.block_hashes[1], image.block_hashes[1], other_image.block_hashes[1]}) == 3


def test_sha256_is_byte_compatible_with_the_pickled_triple(impl: ModuleType) -> None:
    manager = make(impl)
    request = manager.make_request("a", [3, 1, 4, 1, 5, 9, 2, 6])
    # The default seed is vLLM 0.33's (D-HASH-1).
    seed = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert seed == seed_hash("sha256", "vllm-none-hash")
    first = hashlib.sha256(pickle.dumps((seed, (3, 1, 4, 1), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, (5, 9, 2, 6), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert request.block_hashes == [first, second]


def test_events_in_order(impl: ModuleType) -> None:
    manager = make(impl, num_blocks=4, enable_kv_cache_events=True)
    a = manager.make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    manager.evict_blocks([2])
    assert manager.reset_prefix_cache()
    events = manager.take_events()
    assert [type(event) for event in events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert events[0].block_hashes == tuple(a.block_hashes)
    assert events[1].block_hashes == (a.block_hashes[1],)
    assert manager.take_events() == []


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(impl: ModuleType) -> None:
    manager = make(impl)
    a = manager.make_request("a", list(range(9)))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert all(key is None for key in manager.snapshot().pool.block_hashes)


def test_common_prefix_blocks(impl: ModuleType) -> None:
    manager = make(impl, num_blocks=20)
    a = manager.make_request("a", list(range(13)))
    b = manager.make_request("b", list(range(9)) + [0, 0, 0, 0])
    admit(manager, a)
    admit(manager, b)
    assert manager.get_num_common_prefix_blocks("a") == [2]
    c = manager.make_request("c", [7] * 5)
    admit(manager, c)
    assert manager.get_num_common_prefix_blocks("a") == [0]


def test_prefix_cache_stats_and_metrics(impl: ModuleType) -> None:
    manager = make(impl, log_stats=True)
    a = manager.make_request("a", list(range(9)))
    admit(manager, a)
    b = manager.make_request("b", list(range(9)))
    admit(manager, b)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.reset) == (2, 18, 8, False)
    metrics = PrefixCachingMetrics(max_recent_requests=10)
    metrics.observe(stats)
    assert metrics.hit_rate == pytest.approx(8 / 18)
    manager.free(a)
    manager.free(b)
    assert manager.reset_prefix_cache()
    reset_stats = manager.make_prefix_cache_stats()
    assert reset_stats.reset and reset_stats.requests == 0
    metrics.observe(reset_stats)
    assert metrics.hit_rate == 0.0


def test_misuse_raises_typed_errors_and_changes_nothing(impl: ModuleType) -> None:
    manager = make(impl)
    a = manager.make_request("a", list(range(9)))
    before = manager.snapshot()
    with pytest.raises(InvalidTokenCountError):
        manager.allocate_slots(a, 0)
    with pytest.raises(ExceedsMaxModelLenError):
        manager.allocate_slots(a, 65)
    with pytest.raises(UnknownRequestError):
        manager.free(a)
    manager.free(a, missing_ok=True)
    with pytest.raises(UnknownBlockError):
        manager.evict_blocks([1, 12])
    assert manager.snapshot() == before
    admit(manager, a)
    manager.free(a)
    with pytest.raises(UnknownRequestError):
        manager.free(a)


def test_caching_disabled_never_hits_or_hashes_blocks(impl: ModuleType) -> None:
    manager = make(impl, enable_caching=False)
    a = manager.make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    b = manager.make_request("b", list(range(9)))
    assert manager.get_computed_blocks(b)[1] == 0
    assert all(key is None for key in manager.snapshot().pool.block_hashes)
    # Freed unhashed blocks return to the front, tail first.
    assert free_queue(manager)[:3] == (3, 2, 1)
