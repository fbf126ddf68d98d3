"""Sparse retention of sliding-window blocks, the shared-prefix boundary and
per-group hits (spec/managers.md §4, spec/operations.md D.2a, D-SWA-10..12;
diagrams in spec/examples.md "Sparse retention"). One suite over every
implementation."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.reference.features import sparse_retention as rules
from pagedkv.spec.kv_cache_spec import SlidingWindowSpec
from tests.scenario_kit import build_manager, full, window

N = 0  # the null block


def make(impl: ModuleType, *specs: Any, num_blocks: int = 60, **kwargs: Any) -> Any:
    return build_manager(impl, specs, num_blocks=num_blocks, max_model_len=128, **kwargs)


def hashed_positions(manager: Any, request_id: str, group_id: int) -> list[int]:
    """Positions of the request's blocks in ``group_id`` that carry a cache key."""
    hashes = manager.snapshot().pool.block_hashes
    blocks = manager.get_block_ids(request_id)[group_id]
    return [index for index, block in enumerate(blocks) if block != N and hashes[block] is not None]


def test_replay_boundaries_rule() -> None:
    assert rules.replay_boundaries(32, 4, use_eagle=False) == (31,)
    # EAGLE: one unit below the resend's (28) and a longer sibling's (32) aligned ends.
    assert rules.replay_boundaries(32, 4, use_eagle=True) == (24, 28)
    assert rules.replay_boundaries(30, 4, use_eagle=True) == (24,)
    assert rules.replay_boundaries(1, 4, use_eagle=True) == (0,)
    assert rules.replay_boundaries(0, 4, use_eagle=False) == ()


@pytest.mark.parametrize("retention", [None, 0, 16])
def test_pure_swa_zero_retention_keeps_only_the_replay_tail(impl: ModuleType, retention: int | None) -> None:
    """D-SWA-10: block 4, window 4 (one block before a hit), 32 tokens. Dense
    hashes all 8 blocks; retention 0 only block 6, the tail before the replay
    position 31 floored to 28; retention 16 also the tail of each 16-token
    segment (blocks 3 and 7). A replay still hits 28 tokens; a sibling that
    shares 20 tokens hits 20 when block 4 is kept (dense), 16 with block 3
    (retention 16), nothing under retention 0."""
    manager = make(impl, window(), retention_interval=retention)
    tokens = list(range(32))
    request = manager.make_request("a", tokens)
    assert manager.allocate_slots(request, 32) is not None
    expected = {None: list(range(8)), 0: [6], 16: [3, 6, 7]}[retention]
    assert hashed_positions(manager, "a", 0) == expected
    assert manager.get_computed_blocks(manager.make_request("replay", tokens))[1] == 28
    sibling = manager.make_request("sibling", tokens[:20] + [99] * 12)
    assert manager.get_computed_blocks(sibling)[1] == {None: 20, 0: 0, 16: 16}[retention]
    # Unhashed blocks go to the front of the free queue when released, hashed ones to the back.
    blocks = manager.get_block_ids("a")[0]
    manager.free(request)
    queue = manager.snapshot().pool.free_queue
    unhashed = [block for index, block in enumerate(blocks) if index not in expected]
    assert set(queue[:len(unhashed)]) == set(unhashed)


def test_eagle_one_token_prompt_keeps_window_block_zero_under_zero_retention(impl: ModuleType) -> None:
    """D-SWA-10 with EAGLE: a one-token prompt's only replay position is 0,
    whose tail (EAGLE peeks one block further) is block 0; decoding to 8
    tokens hashes block 0 and not block 1."""
    manager = make(impl, window(), use_eagle=True, retention_interval=0)
    request = manager.make_request("a", [5])
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens = 1
    request.append_output_token_ids(list(range(10, 17)))
    assert manager.allocate_slots(request, 7) is not None
    assert hashed_positions(manager, "a", 0) == [0]


def _shared_prefix_run(impl: ModuleType, retention: int | None, pin: bool) -> tuple[int, int]:
    """Requests A, B, C share 16 tokens (4 blocks of 4), then differ; full
    attention + window 4. Returns (B's boundary, C's hit)."""
    manager = make(impl, full(), window(), retention_interval=retention)
    shared = [7] * 16
    first = manager.make_request("A", shared + list(range(100, 116)))
    assert manager.allocate_slots(first, 32) is not None
    second = manager.make_request("B", shared + list(range(200, 216)))
    hit, num_hit = manager.get_computed_blocks(second)
    boundary = manager.shared_prefix_boundary(second, num_hit)
    if pin:
        second.shared_prefix_boundary = boundary
    assert manager.allocate_slots(second, 32 - num_hit, num_hit, hit) is not None
    third = manager.make_request("C", shared + list(range(300, 316)))
    return boundary, manager.get_computed_blocks(third)[1]


def test_shared_prefix_boundary_pins_the_junction_window(impl: ModuleType) -> None:
    """D-SWA-11: under retention 0, A's window group keeps only its replay
    tail, so B hits nothing although full attention caches the 16 shared
    tokens: the boundary is 16. Pinned on B, B keeps its window block 3 and C
    hits 16; unpinned, C misses. Dense retention hits 16 without a pin."""
    assert _shared_prefix_run(impl, None, pin=False) == (0, 16)
    assert _shared_prefix_run(impl, 0, pin=False) == (16, 0)
    assert _shared_prefix_run(impl, 0, pin=True) == (16, 16)


def test_shared_prefix_boundary_is_zero_for_one_group(impl: ModuleType) -> None:
    manager = make(impl, window(), retention_interval=0)
    first = manager.make_request("A", [7] * 16 + list(range(16)))
    assert manager.allocate_slots(first, 32) is not None
    second = manager.make_request("B", [7] * 16 + [9] * 16)
    hit, num_hit = manager.get_computed_blocks(second)
    assert manager.shared_prefix_boundary(second, num_hit) == 0


def test_per_group_hits_are_each_groups_own(impl: ModuleType) -> None:
    """D-SWA-12: after A under retention 0, B's full-attention group alone
    hits 16 tokens (blocks of A's shared prefix) and the window group 0;
    the common hit is 0. The query records no stats and takes nothing."""
    manager = make(impl, full(), window(), retention_interval=0, log_stats=True)
    shared = [7] * 16
    first = manager.make_request("A", shared + list(range(100, 116)))
    assert manager.allocate_slots(first, 32) is not None
    a_full = manager.get_block_ids("A")[0]
    before = manager.snapshot()
    second = manager.make_request("B", shared + list(range(200, 216)))
    hit, lengths = manager.get_computed_blocks_per_group(second)
    assert lengths == (16, 0)
    assert hit.get_block_ids() == (a_full[:4], [])
    assert manager.snapshot() == before
    assert manager.make_prefix_cache_stats().requests == 0


def test_extra_retained_tokens_delay_the_window_release(impl: ModuleType) -> None:
    """D-SWA-13: window 4, block 2, 2 extra retained tokens. After 7 computed
    tokens plain SWA skips 4 tokens (blocks 0, 1 null), the retained window
    only 2 (block 0 null); a hit still needs only the window's blocks."""
    plain = make(impl, SlidingWindowSpec(2, 1, 8, "float16", sliding_window=4))
    kept = make(impl, SlidingWindowSpec(2, 1, 8, "float16", sliding_window=4, extra_retained_tokens=2))
    held = []
    for manager in (plain, kept):
        request = manager.make_request("a", list(range(7)))
        assert manager.allocate_slots(request, 7) is not None
        request.num_computed_tokens = 7
        request.append_output_token_ids(7)
        assert manager.allocate_slots(request, 1) is not None
        held.append(manager.get_block_ids("a")[0])
    assert held[0][:2] == [N, N] and held[0][2] != N
    assert held[1][0] == N and N not in held[1][1:]
    hit, length = kept.get_computed_blocks(kept.make_request("b", list(range(8)) + [50]))
    assert length == 8 and hit.get_block_ids()[0][:2] == [N, N]
    with pytest.raises(Exception, match="extra_retained_tokens"):
        SlidingWindowSpec(2, 1, 8, "float16", sliding_window=4, extra_retained_tokens=-1)


def test_without_full_attention_the_first_cacheable_group_leads(impl: ModuleType) -> None:
    """D-SWA-11 with no full-attention group: group 0 leads. Group 1's copy
    of the shared prefix is evicted, so the common hit is 0 and the junction
    is group 0's own hit."""
    manager = make(impl, window(size=4), window(size=8))
    first = manager.make_request("A", list(range(16)))
    assert manager.allocate_slots(first, 16) is not None
    evicted = manager.get_block_ids("A")[1]
    manager.free(first)
    manager.evict_blocks(evicted)
    second = manager.make_request("B", [*range(16), 99])
    _, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 0
    assert manager.shared_prefix_boundary(second, num_hit) == 16
