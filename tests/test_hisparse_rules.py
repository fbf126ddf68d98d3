"""The pure host-tier rules (pagedkv.reference.features.hisparse_rules) against their definitions.

The optimized side keeps its own copy (pagedkv.optimized.host_tier.hisparse_rules),
which the lockstep machine compares with this one; these tests also state
each rule a second, plainer way, so a mistake made alike in both copies shows.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pagedkv.reference.features.hisparse_rules import (
    check_token_count,
    count_allocation,
    fence_hold,
    plan_allocation,
    residency_update,
    row_mirrors,
    stored_events,
    tally_worker_counts,
    wants_hot_region,
    writeback_tokens,
    writeback_window,
)
from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    InvalidArgumentError,
    InvalidTokenCountError,
)
from pagedkv.spec.hisparse import HostTierConfig, ResidencyUpdate, RowMirror
from pagedkv.spec.types import BlockHash

B = 4
CFG = HostTierConfig(block_size=B, host_num_blocks=10, device_num_blocks=10,
                     hot_blocks_per_request=2, max_model_len=32, num_reprefillable_tokens=3)


def _token_wise_mirrors(resident: list[int], host: list[int], start: int,
                        count: int) -> list[RowMirror]:
    """The definition: each token row of a resident page, merged while both
    slots stay contiguous inside one page."""
    mirrors: list[RowMirror] = []
    for token in range(start, start + count):
        page, offset = divmod(token, B)
        if page >= len(resident) or resident[page] == 0:
            continue
        device, host_slot = resident[page] * B + offset, host[page] * B + offset
        last = mirrors[-1] if mirrors else None
        if last is not None and offset and last.device_slot + last.num_rows == device and (
                last.host_slot + last.num_rows == host_slot):
            mirrors[-1] = RowMirror(last.device_slot, last.host_slot, last.num_rows + 1)
        else:
            mirrors.append(RowMirror(device, host_slot, 1))
    return mirrors


@given(rows=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 9)), max_size=6),
       start=st.integers(0, 30), count=st.integers(0, 12))
def test_row_mirrors_match_the_token_wise_definition(rows: list[tuple[int, int]], start: int,
                                                     count: int) -> None:
    resident, host = [r for r, _ in rows], [h for _, h in rows]
    assert row_mirrors(B, resident, host, start, count) == _token_wise_mirrors(
        resident, host, start, count)


def test_row_mirrors_concrete() -> None:
    # Page 0 in device block 3 / host block 5, page 1 host-only, page 2 in 7 / 2.
    assert row_mirrors(B, [3, 0, 7], [5, 6, 2], 2, 9) == [
        RowMirror(14, 22, 2), RowMirror(28, 8, 3)]
    with pytest.raises(InvalidTokenCountError, match="num_scheduled_tokens"):
        row_mirrors(B, [3], [5], 0, -1)


def test_residency_update_sends_stale_pages_then_new_ones() -> None:
    assert residency_update([4, 0, 6, 7, 8], 3, {1}) == ResidencyUpdate((1, 3, 4), (0, 7, 8))
    assert residency_update([4, 0], 2, set()) is None


def test_writeback_tokens_and_window() -> None:
    assert writeback_tokens(CFG, 8) == 5 and writeback_tokens(CFG, 2) == 0
    assert writeback_window(B, 13, 4, 0) == range(0, 3)
    assert writeback_window(B, 13, 2, 0) == range(0, 2)  # not beyond the row
    assert writeback_window(B, 16, 4, 6) == range(2, 4)  # an import writes pages 0, 1
    with pytest.raises(InvalidTokenCountError):
        writeback_tokens(CFG, -1)


def test_wants_hot_region_below_the_watermark_or_at_the_window() -> None:
    windowed = HostTierConfig(block_size=B, host_num_blocks=10, device_num_blocks=40,
                              hot_blocks_per_request=2, max_model_len=32, admission_window=3)
    assert windowed.device_watermark == 4
    assert wants_hot_region(windowed, 3, 1) and not wants_hot_region(windowed, 4, 2)
    assert wants_hot_region(windowed, 4, 3)


def test_tally_worker_counts() -> None:
    counts, done = tally_worker_counts({}, {0, 1, 2}, {0: 2, 1: 0, 7: 1}, {0: 1, 1: 1, 7: 1})
    assert counts == {0: (2, 1), 1: (0, 1)} and done == []
    counts, done = tally_worker_counts(counts, {0, 1, 2}, {0: 9, 1: 1}, {0: 1})
    assert counts == {} and done == [0, 1]
    # Counts of a transfer no longer in flight are dropped.
    assert tally_worker_counts({5: (2, 1)}, {0}, {}, {}) == ({}, [])
    with pytest.raises(InvalidArgumentError, match=r"completed\[0\]"):
        tally_worker_counts({}, {0}, {}, {0: -1})


@given(enqueued=st.lists(st.integers(0, 3), min_size=1, max_size=4),
       completed=st.lists(st.integers(0, 2), min_size=1, max_size=4))
def test_a_transfer_finishes_once_its_first_expectation_is_met(enqueued: list[int],
                                                              completed: list[int]) -> None:
    counts: dict[int, tuple[int, int]] = {}
    finished_at = None
    for step, (e, c) in enumerate(zip(enqueued, completed, strict=False)):
        counts, done = tally_worker_counts(counts, {0}, {0: e}, {0: c})
        if done:
            finished_at = step
            break
    expected = next((e for e in enqueued if e), 0)
    steps = min(len(enqueued), len(completed))
    first = next((s for s in range(steps)
                  if expected and any(enqueued[:s + 1])
                  and sum(completed[:s + 1]) >= expected), None)
    assert finished_at == first


def test_plan_allocation_refusals() -> None:
    hashes = [BlockHash(bytes([i])) for i in range(4)]
    kwargs = dict(held_pages=0, held_hashes=(), has_hot=False, hot_required=False,
                  host_hash_of={1: hashes[0]}, host_ref=[0] * 10)
    counts = plan_allocation(CFG, "r", 9, [1], hashes, 0, **kwargs)  # type: ignore[arg-type]
    assert (counts.host_new, counts.free_hits, counts.hot_n, counts.device_new) == (2, 1, 2, 2)
    with pytest.raises(ExceedsMaxModelLenError):
        plan_allocation(CFG, "r", 33, (), hashes, 0, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="hit"):
        plan_allocation(CFG, "r", 9, [2], hashes, 0, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="num_external_tokens"):
        plan_allocation(CFG, "r", 4, (), hashes, 5, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokenCountError):
        check_token_count("n", 1.5)


@example(num_tokens=8, hit=1, local=3, external=0)
@example(num_tokens=13, hit=3, local=8, external=4)
@given(num_tokens=st.integers(1, 32), hit=st.integers(0, 4), local=st.integers(0, 16),
       external=st.integers(0, 16))
def test_an_import_layout_by_pages(num_tokens: int, hit: int, local: int, external: int) -> None:
    """count_allocation's page layout, stated page by page: the computed hit
    pages (whole), then the import's pages host-only but its last, then
    resident pages; a partial computed page costs one host block (HOST-14,
    D-HOST-22/23)."""
    kwargs = dict(held_pages=0, has_hot=False, hot_required=False, host_ref=[1] * 10)
    blocks = list(range(1, hit + 1))
    try:
        counts = count_allocation(CFG, "r", num_tokens, blocks, external,
                                  num_local_tokens=local, **kwargs)  # type: ignore[arg-type]
    except InvalidArgumentError:
        covered = max(-(-local // B), -(-(local + external) // B) if external else 0)
        assert hit > -(-num_tokens // B) or local > hit * B or hit > covered or (
            external and local + external > num_tokens)
        return
    pages = -(-num_tokens // B)
    imported = local + external if external else 0
    # A partial computed page is host-only (copied on host before it is written)
    # unless an import covers it.
    computed = local // B if imported else -(-local // B)
    layout = ["hit" if p < computed else "import" if p < -(-imported // B) - 1 else "resident"
              for p in range(pages)]
    assert counts.host_only == layout.count("hit") + layout.count("import")
    assert counts.device_new == layout.count("resident")
    assert counts.host_new == pages - hit and counts.cow == int(hit > 0 and local % B > 0)
    assert counts.clean_hits == local // B


def test_stored_events_split_into_runs() -> None:
    hashes = [BlockHash(bytes([i])) for i in range(6)]
    events = stored_events("r", False, hashes, [(1, 11), (2, 12), (4, 14)])
    assert [(e.first_page, e.block_hashes, e.host_blocks, e.parent_hash) for e in events] == [
        (1, (hashes[1], hashes[2]), (11, 12), hashes[0]), (4, (hashes[4],), (14,), hashes[3])]
    assert stored_events("r", True, hashes, []) == []


def test_a_fence_holds_what_a_step_may_write() -> None:
    hold = fence_hold(3, [7, 8, 9], [4, 0, 6], clean={0, 1, 2}, pending={2}, hot=[1, 2])
    assert (hold.fence_id, hold.host_blocks, hold.resident_blocks, hold.hot_blocks) == (
        3, (7, 8, 9), (6,), (1, 2))
