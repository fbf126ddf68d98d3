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
from pagedkv.spec.mamba_spec import MambaSpec


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


def test_computed_tokens_without_their_blocks_are_refused(impl: ModuleType) -> None:
    """D-API-47: vLLM's ``test_boundary_states_offered_past_prompt_for_resumed_prefill``
    re-admits a resumed request with ``num_new_computed_tokens = 8`` but no
    ``new_computed_blocks``: vLLM gives it fresh blocks and treats tokens 0..7
    as computed in them though nothing wrote them. pagedkv refuses, nothing
    changes; handed its hit, the request gets the blocks and the past-prompt
    boundary offer vLLM's test asks for (block 6, boundary 16)."""
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(8, 1, 1, "float32")),
              KVCacheGroupSpec(("mamba",), MambaSpec(8, shapes=((1,),), dtypes=("float32",),
                                                     mamba_cache_mode="align")))
    manager = impl.KVCacheManager(KVCacheConfig(200, (), groups), 8192, hash_block_size=8)
    request = manager.make_request("0", [0] * 8)
    manager.new_step_starts()
    assert manager.allocate_slots(request, 8) is not None
    assert manager.take_boundary_state_offloads() == {"0": [(1, 2, 8)]}
    for position in range(8, 16):  # decode past the prompt, to the next boundary
        manager.new_step_starts()
        request.num_computed_tokens = position
        request.append_output_token_ids([1])
        assert manager.allocate_slots(request, 1) is not None
    assert manager.take_boundary_state_offloads() == {"0": [(1, 4, 16)]}
    manager.free(request)
    manager.new_step_starts()
    request.num_computed_tokens = 0
    hit, num_hit = manager.get_computed_blocks(request)
    assert (hit.get_block_ids(), num_hit) == (([1], [2]), 8)
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError, match="does not match the 0 computed blocks of group 0"):
        manager.allocate_slots(request, 8, 8)
    assert manager.snapshot() == before
    assert manager.allocate_slots(request, 8, 8, hit) is not None
    assert manager.get_block_ids("0") == ([1, 5], [2, 6])
    assert manager.take_boundary_state_offloads() == {"0": [(1, 6, 16)]}
