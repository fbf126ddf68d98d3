"""Where pagedkv deliberately answers otherwise than vLLM 0.33 (each a
decision of spec/decisions.md), pinned with concrete block ids on both
implementations. vLLM's own tests that rely on vLLM's answer fail with
pagedkv swapped in; the decisions name them."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidArgumentError, InvalidTokenCountError


def manager_of(impl: ModuleType) -> Any:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(4, 1, 8, "float16")),)
    return impl.KVCacheManager(KVCacheConfig(10, (), groups), 100, hash_block_size=4)


def fabricated_hit(impl: ModuleType, manager: Any, block_ids: list[int]) -> Any:
    """A ``KVCacheBlocks`` naming ``block_ids``, in the implementation's representation."""
    if impl.__name__.endswith("reference"):
        return impl.KVCacheBlocks([[manager.block_pool.blocks[i] for i in block_ids]])
    return impl.KVCacheBlocks(([*block_ids],), manager.block_pool.block_hashes)


def test_a_hit_of_never_cached_free_blocks_is_refused(impl: ModuleType) -> None:
    """D-VLLM-5: vLLM's connector tests (``test_cache_hit_local_and_external*``)
    hand blocks from the free queue's head as a "hit": 1..4 here, never
    cached, holding no KV of the request. pagedkv refuses, nothing changes."""
    manager = manager_of(impl)
    request = manager.make_request("a", [0] * 32)
    before = manager.snapshot()
    assert before.pool.free_queue[:4] == (1, 2, 3, 4)
    with pytest.raises(InvalidArgumentError, match="stale new_computed_blocks: group 0 position 0: block 1"):
        manager.allocate_slots(request, 16, 16, fabricated_hit(impl, manager, [1, 2, 3, 4]), 0, 0)
    assert manager.snapshot() == before


def test_an_empty_request_is_refused(impl: ModuleType) -> None:
    """D-API-43: ``request.num_tokens == 0`` is refused (vLLM allocates for it)."""
    manager = manager_of(impl)
    empty = SimpleNamespace(
        request_id="empty", all_token_ids=[], num_tokens=0, num_prompt_tokens=0, num_computed_tokens=0,
        block_hashes=[], num_preemptions=0, lora_id=None, lora_name=None, cache_salt=None, mm_features=(),
        skip_reading_prefix_cache=False)
    before = manager.snapshot()
    with pytest.raises(InvalidTokenCountError, match="num_tokens must be an int >= 1"):
        manager.allocate_slots(empty, 3, num_lookahead_tokens=2)
    assert manager.snapshot() == before


def test_an_unknown_request_with_computed_tokens_is_refused(impl: ModuleType) -> None:
    """D-API-21: a new request arriving with ``num_computed_tokens = 30`` (vLLM's
    disaggregated-decode padding test) would have blocks 1, 2 cached without
    ever being written; pagedkv refuses."""
    manager = manager_of(impl)
    request = manager.make_request("boundary", list(range(31)))
    request.num_computed_tokens = 30
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError, match="D-API-21"):
        manager.allocate_slots(request, 1)
    assert manager.snapshot() == before
