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


# vLLM 0.33's two admission gates for the same calls, recorded from stock vLLM
# (the setup of its test_full_sequence_admission_reserves_device_blocks_for_immediate_chunk:
# 16-token blocks, 10 usable, a new 128-token request that needs 8 blocks in all):
# (watermark_blocks, reserved_blocks, full_sequence_must_fit, num_new_tokens, new block ids).
TWO_GATES = [
    (0, 4, True, 16, [1]),  # vLLM's [4-True]: 1 + 4 <= 10 for the chunk, 8 <= 10 for the whole
    (0, 10, True, 16, None),  # vLLM's [10-False]: 1 + 10 > 10
    (0, 9, True, 16, [1]),
    (0, 9, True, 40, None),  # 3 + 9 > 10
    (1, 4, True, 40, [1, 2, 3]),
    (1, 9, True, 16, None),  # 1 + 9 + 1 > 10
    (2, 2, True, 40, [1, 2, 3]),  # the whole request: 8 + 2 = 10
    (3, 0, True, 16, None),  # the whole request: 8 + 3 > 10
    (3, 0, False, 16, [1]),
    (3, 4, False, 40, [1, 2, 3]),  # 3 + 4 + 3 = 10
    (3, 9, False, 16, None),
]


def test_watermark_keeps_both_gates_reserved_blocks_the_step_only(impl: ModuleType) -> None:
    """D-API-48: the step's demand keeps reserved_blocks and the watermark
    free, the whole request (full_sequence_must_fit) the watermark only;
    block for block what vLLM 0.33 gives for the same calls. The optimized
    manager is tried on its admission step and on the general path."""
    for watermark, reserved, whole, chunk, expected in TWO_GATES:
        managers = [build_manager(impl, (full(16),), num_blocks=11, max_model_len=128)]
        if hasattr(managers[0].coordinator, "admit_step"):  # optimized: the general path too
            managers.append(build_manager(impl, (full(16),), num_blocks=11, max_model_len=128))
            managers[1].coordinator.admit_step = None
        for manager in managers:
            request = manager.make_request("chunk", list(range(128)))
            before = manager.snapshot()
            blocks = manager.allocate_slots(request, chunk, full_sequence_must_fit=whole,
                                            reserved_blocks=reserved, watermark_blocks=watermark)
            case = (watermark, reserved, whole, chunk)
            if expected is None:
                assert blocks is None, case
                assert manager.snapshot() == before, case
            else:
                assert blocks is not None and blocks.get_block_ids() == (expected,), case
            assert manager.block_pool.get_num_free_blocks() == 10 - len(expected or []), case


def test_watermark_holds_on_decode_steps(impl: ModuleType) -> None:
    """D-API-48: a known request's step keeps the watermark too (the
    optimized decode fast path steps aside for it); a refusal changes nothing."""
    manager = make(impl, num_blocks=4)  # 3 usable blocks of 4 tokens
    request = manager.make_request("r", list(range(4)))
    assert manager.allocate_slots(request, 4) is not None
    request.num_computed_tokens = 4
    request.append_output_token_ids(7)  # the 5th token needs a 2nd block; 2 are free
    before = manager.snapshot()
    assert manager.allocate_slots(request, 1, watermark_blocks=2) is None
    assert manager.allocate_slots(request, 1, watermark_blocks=1, reserved_blocks=1) is None
    assert manager.snapshot() == before
    blocks = manager.allocate_slots(request, 1, watermark_blocks=1)
    assert blocks is not None and blocks.get_block_ids() == ([2],)


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
