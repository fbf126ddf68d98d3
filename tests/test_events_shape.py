"""The two shapes of ``BlockStored`` (spec/operations.md, ``cache_full_blocks``;
D-EVT-15): vLLM's one event per caching call (the default) and the opt-in
split into one event per contiguous run, on a full-attention plus
sliding-window hybrid whose retention mask leaves gaps in the window group.

Every test runs on both implementations (the ``impl`` fixture); the lockstep
machines draw both settings too (``tests/strategies.py``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.types import BlockStored
from tests.scenario_kit import build_manager, full, window

BLOCK = 4
CHUNK = 8  # two blocks per scheduler step: each step caches a two-block range


def chunked_prefill(mode: str | None, impl: ModuleType, *, retention: int, tokens: int = 30) -> tuple[Any, Any]:
    """A hybrid manager (group 0 full attention, group 1 a 4-token window)
    with events on, after a ``tokens``-token prompt prefilled ``CHUNK``
    tokens a step; ``mode`` ``None`` leaves the option at its default."""
    options: dict[str, Any] = {} if mode is None else {"block_stored_events": mode}
    manager = build_manager(impl, (full(BLOCK), window(BLOCK, 4)), num_blocks=40, max_model_len=64,
                            enable_kv_cache_events=True, retention_interval=retention, **options)
    request = manager.make_request("a", list(range(tokens)))
    while request.num_computed_tokens < request.num_tokens:
        step = min(CHUNK, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, step) is not None
        request.num_computed_tokens += step
    return manager, request


def stored(manager: Any, group: int) -> list[tuple[tuple[bytes, ...], bytes | None, tuple[int, ...]]]:
    """(hashes, parent, tokens) of the group's ``BlockStored`` events, in order."""
    return [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in manager.take_events()
            if isinstance(e, BlockStored) and e.group_idx == group]


def expected(request: Any, ranges: list[tuple[int, int, list[int]]]) -> list[tuple[Any, ...]]:
    """The events for ``(first, end, keyed positions)`` block ranges."""
    h, t = request.block_hashes, tuple(request.all_token_ids)
    return [(tuple(h[i] for i in keyed), None if first == 0 else h[first - 1], t[first * BLOCK:end * BLOCK])
            for first, end, keyed in ranges]


# Retention interval 8 (two blocks): the window group keeps every other block of a range, so
# each two-block step keys one block of the window group: a gap in every range.
GAPPED_PER_CALL = [(0, 2, [1]), (2, 4, [3]), (4, 6, [5]), (6, 7, [6])]
GAPPED_PER_RUN = [(1, 2, [1]), (3, 4, [3]), (5, 6, [5]), (6, 7, [6])]


@pytest.mark.parametrize("mode", [None, "per_call"])
def test_per_call_is_the_default_and_is_vllms_shape(impl: ModuleType, mode: str | None) -> None:
    manager, request = chunked_prefill(mode, impl, retention=8)
    events = manager.take_events()
    window_events = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events
                     if isinstance(e, BlockStored) and e.group_idx == 1]
    # One event per call: the range's parent and tokens, only the keyed hashes.
    assert window_events == expected(request, GAPPED_PER_CALL)
    full_events = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events
                   if isinstance(e, BlockStored) and e.group_idx == 0]
    assert full_events == expected(request, [(0, 2, [0, 1]), (2, 4, [2, 3]), (4, 6, [4, 5]), (6, 7, [6])])


def test_per_run_splits_at_gaps_into_valid_chain_segments(impl: ModuleType) -> None:
    manager, request = chunked_prefill("per_run", impl, retention=8)
    assert stored(manager, 1) == expected(request, GAPPED_PER_RUN)


@pytest.mark.parametrize(("mode", "ranges"), [
    # Retention 0: the window group keys only the prompt's last block: every earlier call
    # keys nothing. vLLM still sends its event, with no hash; the split sends none.
    ("per_call", [(0, 2, []), (2, 4, []), (4, 6, []), (6, 7, [6])]),
    ("per_run", [(6, 7, [6])]),
])
def test_a_call_that_keys_nothing(impl: ModuleType, mode: str, ranges: list[tuple[int, int, list[int]]]) -> None:
    manager, request = chunked_prefill(mode, impl, retention=0)
    assert stored(manager, 1) == expected(request, ranges)


def test_both_settings_agree_without_gaps(impl: ModuleType) -> None:
    shapes = []
    for mode in ("per_call", "per_run"):
        manager, _ = chunked_prefill(mode, impl, retention=4)
        shapes.append([(e.group_idx, e.block_hashes, e.parent_block_hash, e.token_ids)
                       for e in manager.take_events() if isinstance(e, BlockStored)])
    assert shapes[0] == shapes[1] and len(shapes[0]) == 8


@pytest.mark.parametrize("bad", ["per-call", "", None, True, 1, "PER_RUN"])
def test_a_bad_setting_is_refused_by_name(impl: ModuleType, bad: object) -> None:
    with pytest.raises(InvalidConfigError, match="block_stored_events"):
        build_manager(impl, (full(BLOCK),), num_blocks=8, max_model_len=16, block_stored_events=bad)
