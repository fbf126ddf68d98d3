"""Scenarios pinning the vLLM 0.33 engine contract (spec/operations.md Part D),
over every implementation. Each test names the decision it pins."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.spec import (
    InvalidConfigError,
    InvalidTokenCountError,
)
from tests.scenario_kit import build_manager, full, window


def make(impl: ModuleType, *specs: Any, num_blocks: int = 12, **kwargs: Any) -> Any:
    return build_manager(impl, specs or (full(),), num_blocks=num_blocks, max_model_len=64, **kwargs)


def test_zero_new_tokens_adopt_external_tokens(impl: ModuleType) -> None:
    """D-API-12: an asynchronous KV load allocates for its tokens with no new ones."""
    manager = make(impl)
    request = manager.make_request("r", list(range(16)))
    with pytest.raises(InvalidTokenCountError):
        manager.allocate_slots(request, 0)  # nothing to adopt
    blocks = manager.allocate_slots(request, 0, num_external_computed_tokens=8, delay_cache_blocks=True)
    # The loaded tokens' blocks are the request's now; as in vLLM, only blocks
    # for new tokens are returned, and there are none.
    assert blocks is not None and blocks.get_block_ids() == ([],)
    assert [len(group) for group in manager.get_block_ids("r")] == [2]
    assert manager.snapshot().requests[0].num_cached_blocks == (0,)
    request.num_computed_tokens = 8  # the load finished
    manager.cache_blocks(request, 8)
    assert manager.snapshot().requests[0].num_cached_blocks == (2,)


def test_reserved_blocks_are_kept_free(impl: ModuleType) -> None:
    """D-VLLM-4 / Part D.1: demand + reserved_blocks must fit; a refusal changes nothing."""
    manager = make(impl)  # 11 usable blocks
    request = manager.make_request("r", list(range(12)))  # 3 blocks
    before = manager.snapshot()
    assert manager.allocate_slots(request, 12, reserved_blocks=9) is None
    assert manager.snapshot() == before
    assert manager.allocate_slots(request, 12, reserved_blocks=8) is not None
    with pytest.raises(InvalidTokenCountError):
        manager.allocate_slots(request, 1, reserved_blocks=-1)


def test_in_flight_tokens_keep_their_window(impl: ModuleType) -> None:
    """D-API-14: skipped blocks are removed on the settled basis, total - in flight."""
    settled = make(impl, window(), num_blocks=20)
    async_ = make(impl, window(), num_blocks=20)
    for manager, in_flight in ((settled, 0), (async_, 16)):
        request = manager.make_request("r", list(range(40)))
        assert manager.allocate_slots(request, 32) is not None
        request.num_computed_tokens = 32
        assert manager.allocate_slots(request, 1, num_in_flight_tokens=in_flight) is not None
    nulls = [manager.get_block_ids("r")[0].count(0) for manager in (settled, async_)]
    # window 4: skipped(T) = T - 3 tokens; T = 32 -> 7 blocks, T = 16 -> 3 blocks.
    assert nulls == [7, 3]


def test_lagging_block_hasher_caches_the_hashed_blocks(impl: ModuleType) -> None:
    """D-API-11: a request whose hashes lag caches what is hashed instead of refusing."""
    manager = make(impl)
    request = manager.make_request("r", list(range(12)))
    lagging = request.block_hashes.pop()  # the engine has hashed only 2 of 3 blocks
    assert manager.allocate_slots(request, 12) is not None
    assert manager.snapshot().requests[0].num_cached_blocks == (2,)
    request.block_hashes.append(lagging)
    request.num_computed_tokens = 12
    manager.cache_blocks(request, 12)
    assert manager.snapshot().requests[0].num_cached_blocks == (3,)


def test_positive_retention_needs_a_window_or_mamba_group(impl: ModuleType) -> None:
    """D-CFG-12: retention only sparsifies sliding-window and Mamba groups."""
    with pytest.raises(InvalidConfigError, match="no sliding-window or Mamba"):
        make(impl, retention_interval=4)
    make(impl, retention_interval=0)  # dense: accepted
    make(impl, full(), window(), retention_interval=4)


def test_mixed_block_sizes_cache_whole_alignment_units(impl: ModuleType) -> None:
    """D-HIT-5: full attention 8 + sliding window 4 (alignment 8), 28 tokens computed:
    caching stops at 24 tokens, so SWA caches 6 blocks (not 7) and full attention 3."""
    manager = make(impl, full(8), window(4, 8), num_blocks=40, hash_block_size=4)
    request = manager.make_request("r", [t // 4 for t in range(28)] + [99])
    assert manager.allocate_slots(request, 28) is not None
    assert manager.snapshot().requests[0].num_cached_blocks == (3, 6)


def test_eagle_caches_one_block_past_the_alignment(impl: ModuleType) -> None:
    """D-HIT-5: with EAGLE the block after the last alignment unit is cached too
    (the hit predicate reads it); 28 tokens: full attention 3 + 1 -> 3 (28 // 8),
    sliding window 6 + 1 = 7."""
    manager = make(impl, full(8), window(4, 8), num_blocks=40, hash_block_size=4, use_eagle=True)
    request = manager.make_request("r", [t // 4 for t in range(28)] + [99])
    assert manager.allocate_slots(request, 28) is not None
    assert manager.snapshot().requests[0].num_cached_blocks == (3, 7)
