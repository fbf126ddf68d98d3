"""Differential tests: ``BlockTables`` and slot mapping (torch) against
``pagedkv.reference.features.tensor_model`` (plain Python), on CPU and on CUDA when present."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv.optimized.tensor import PAD_SLOT_ID, BlockTables, token_batch  # noqa: E402
from pagedkv.reference.features.tensor_model import (  # noqa: E402
    ReferenceBlockTables,
    reference_slot_mapping,
    reference_slot_mapping_padded,
    reference_token_batch,
)
from pagedkv.spec.errors import InvalidArgumentError, PagedKVError  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]

NUM_BLOCKS = 40


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[int], int, list[int]]:
    num_groups = draw(st.integers(1, 3))
    block_sizes = draw(st.lists(st.sampled_from([1, 2, 4, 16]), min_size=num_groups,
                                max_size=num_groups))
    widths = draw(st.lists(st.integers(1, 6), min_size=num_groups, max_size=num_groups))
    return block_sizes, draw(st.integers(1, 6)), widths


def _ids(num_groups: int, max_len: int) -> st.SearchStrategy[list[list[int]]]:
    # Mostly valid ids, sometimes out of range, to exercise the errors.
    block_id = st.one_of(st.integers(0, NUM_BLOCKS - 1), st.integers(-2, NUM_BLOCKS + 2))
    return st.lists(st.lists(block_id, max_size=max_len), min_size=num_groups,
                    max_size=num_groups)


def _apply(op: tuple[object, ...], tables: BlockTables, ref: ReferenceBlockTables) -> None:
    """Run one operation on both; they must fail the same way or agree."""
    name, args = op[0], op[1:]
    outcomes: list[object] = []
    for target in (tables, ref):
        try:
            outcomes.append(getattr(target, str(name))(*args))
        except PagedKVError as error:
            outcomes.append(type(error))
    assert outcomes[0] == outcomes[1], (op, outcomes)


def _check_equal(tables: BlockTables, ref: ReferenceBlockTables) -> None:
    tables.commit()
    tables.check_invariants()
    for g in range(ref.num_groups):
        assert tables.table(g).cpu().tolist() == ref.table(g)
        assert tables.host_table(g).tolist() == ref.table(g)
        for r in range(ref.max_num_reqs):
            assert tables.num_blocks_in_row(r, g) == ref.num_blocks_per_row(g)[r]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60)
@given(layout=_layouts(), data=st.data())
def test_block_tables_match_reference(device: str, layout: tuple[list[int], int, list[int]],
                                      data: st.DataObject) -> None:
    block_sizes, max_reqs, widths = layout
    tables = BlockTables(block_sizes, max_reqs, widths, NUM_BLOCKS, device=device)
    ref = ReferenceBlockTables(block_sizes, max_reqs, widths, NUM_BLOCKS)
    row = st.integers(-1, max_reqs)
    g = len(block_sizes)
    for _ in range(data.draw(st.integers(1, 25))):
        kind = data.draw(st.sampled_from(
            ["add", "add", "append", "append", "null", "remove", "move", "swap", "condense",
             "commit"]))
        if kind == "add":
            op: tuple[object, ...] = ("add_request", data.draw(row), data.draw(_ids(g, 4)))
        elif kind == "append":
            op = ("append_blocks", data.draw(row), data.draw(_ids(g, 3)))
        elif kind == "null":
            op = ("set_null", data.draw(row), data.draw(st.integers(0, g)),
                  data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6)))
        elif kind == "remove":
            op = ("remove_request", data.draw(row))
        elif kind == "move":
            op = ("move_row", data.draw(row), data.draw(row))
        elif kind == "swap":
            op = ("swap_rows", data.draw(st.integers(0, max_reqs - 1)),
                  data.draw(st.integers(0, max_reqs - 1)))
        elif kind == "condense":
            op = ("condense",)
        else:
            tables.commit()
            _check_equal(tables, ref)
            continue
        _apply(op, tables, ref)
    _check_equal(tables, ref)

    # Slot mapping of a batch over the occupied rows, tokens within their blocks.
    occupied = [r for r in range(max_reqs) if ref.is_occupied(r)]
    rows, starts, counts = [], [], []
    for r in occupied:
        limit = min(n * bs for n, bs in zip(
            [ref.num_blocks_per_row(gi)[r] for gi in range(g)], block_sizes))
        if limit == 0:
            continue
        start = data.draw(st.integers(0, limit - 1))
        rows.append(r)
        starts.append(start)
        counts.append(data.draw(st.integers(0, limit - start)))
    expected_rows, expected_pos = reference_token_batch(rows, starts, counts)
    num_tokens = len(expected_pos)

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    token_rows, positions = token_batch(dev(rows), dev(starts), dev(counts), num_tokens)
    assert token_rows.tolist() == expected_rows and positions.tolist() == expected_pos
    tables.check_batch(expected_rows, expected_pos)
    slots = tables.slot_mapping(token_rows, positions)
    assert slots.dtype == torch.int64 and tuple(slots.shape) == (g, num_tokens)
    num_padded = num_tokens + data.draw(st.integers(0, 5))
    out = torch.full((g, num_padded + 2), 7, dtype=torch.int64, device=device)
    padded = tables.slot_mapping_padded(token_rows, positions, out, num_padded)
    assert padded.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    for gi, bs in enumerate(block_sizes):
        expected = reference_slot_mapping(ref.table(gi), bs, expected_rows, expected_pos)
        assert slots[gi].tolist() == expected
        assert padded[gi].tolist() == reference_slot_mapping_padded(
            ref.table(gi), bs, expected_rows, expected_pos, num_padded)
    if num_tokens < num_padded:
        assert int(padded[0, -1]) == PAD_SLOT_ID


def test_slot_mapping_example() -> None:
    """The docstring example: block size 4, row [7, 2, 9]."""
    tables = BlockTables([4], 2, [4], 16)
    tables.add_request(1, [[7, 2, 9]])
    tables.commit()
    rows, pos = token_batch(torch.tensor([1]), torch.tensor([2]), torch.tensor([8]), 8)
    assert tables.slot_mapping(rows, pos).tolist() == [[30, 31, 8, 9, 10, 11, 36, 37]]


def test_errors_leave_the_table_unchanged() -> None:
    tables = BlockTables([2, 4], 2, [3, 2], 10)
    tables.add_request(0, [[1, 2], [3]])
    before = [tables.host_table(g).copy() for g in range(2)]
    calls: list[Callable[[], None]] = [
        lambda: tables.append_blocks(0, [[4, 5], [99]]),    # second group bad
        lambda: tables.append_blocks(0, [[4, 5], [6, 7]]),  # second group too long
        lambda: tables.add_request(0, [[1], [1]]),
        lambda: tables.set_null(0, 1, 0, 2)]
    for call in calls:
        with pytest.raises(PagedKVError):
            call()
        for g in range(2):
            assert (tables.host_table(g) == before[g]).all()
    with pytest.raises(InvalidArgumentError):
        tables.slot_mapping_padded(torch.zeros(3, dtype=torch.int64),
                                   torch.zeros(3, dtype=torch.int64),
                                   torch.zeros((2, 2), dtype=torch.int64), 2)
    with pytest.raises(InvalidArgumentError):
        tables.check_batch([0], [4])
