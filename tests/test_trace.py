"""The standard chat trace: its shape (the anchors' call counts), determinism,
and a replay through each implementation with the engine-side bookkeeping."""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

import pytest

from pagedkv.trace import (
    STANDARD,
    AddRequest,
    AllocateSlots,
    AppendToken,
    Free,
    GetComputedBlocks,
    TraceConfig,
    TraceDriver,
    TraceError,
    make_manager,
    peak_blocks,
    standard_trace,
)

SMALL = TraceConfig(num_requests=6, batch_size=3, num_system_prompts=2, decode_steps=20)


def _implementations() -> list[str]:
    return [name for name in ("reference", "optimized")
            if hasattr(importlib.import_module(f"pagedkv.{name}"), "KVCacheManager")]


IMPLEMENTATIONS: list[Any] = list(_implementations()) or [
    pytest.param("none", marks=pytest.mark.skip(reason="no KVCacheManager implementation yet"))]


def test_standard_trace_has_the_anchors_call_counts() -> None:
    kinds = Counter(type(step).__name__ for step in standard_trace())
    assert kinds == {"AddRequest": 256, "GetComputedBlocks": 256, "AllocateSlots": 33040,
                     "AppendToken": 256 * 128, "Free": 256}
    assert STANDARD.expected_hit_tokens == 1024
    assert peak_blocks() == 64 * (104 - 64) + 8 * 64


def test_standard_trace_shape() -> None:
    steps = list(standard_trace(SMALL))
    adds = [s for s in steps if isinstance(s, AddRequest)]
    assert all(len(s.prompt_token_ids) == 1536 for s in adds)
    assert all(0 <= t < 32000 for s in adds for t in s.prompt_token_ids)
    # requests 0 and 2 share system prompt 0, unique tails differ
    assert adds[0].prompt_token_ids[:1024] == adds[2].prompt_token_ids[:1024]
    assert adds[0].prompt_token_ids[:1024] != adds[1].prompt_token_ids[:1024]
    assert adds[0].prompt_token_ids[1024:] != adds[2].prompt_token_ids[1024:]
    lookups = [s for s in steps if isinstance(s, GetComputedBlocks)]
    assert [s.expected_hit_tokens for s in lookups] == [0, 0, 1024, 1024, 1024, 1024]
    first_chunks = [s for s in steps if isinstance(s, AllocateSlots) and s.uses_prefix_hit]
    assert [(s.num_new_tokens, s.num_new_computed_tokens) for s in first_chunks] == (
        [(512, 0), (512, 0)] + [(512, 1024)] * 4)
    # no-hit requests prefill in three chunks of 512
    prefill = [s.num_new_tokens for s in steps
               if isinstance(s, AllocateSlots) and s.request_id == "req-00000" and s.num_new_tokens > 1]
    assert prefill == [512, 512, 512]
    assert sum(isinstance(s, AppendToken) for s in steps) == 6 * 20
    assert [s.request_id for s in steps if isinstance(s, Free)] == [f"req-{i:05d}" for i in range(6)]


def test_trace_is_deterministic() -> None:
    assert list(standard_trace(SMALL)) == list(standard_trace(SMALL))
    assert list(standard_trace(SMALL)) != list(standard_trace(TraceConfig(
        num_requests=6, batch_size=3, num_system_prompts=2, decode_steps=20, seed=1)))


def test_trace_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        TraceConfig(batch_size=0)
    with pytest.raises(ValueError, match="decode_steps"):
        TraceConfig(decode_steps=-1)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_driver_replays_the_trace(implementation: str) -> None:
    manager = make_manager(implementation, num_blocks=peak_blocks(SMALL) + 1, hash_fn="xxh3_128")
    driver = TraceDriver(manager)
    scheduled: dict[str, int] = {}
    final: dict[str, tuple[int, int]] = {}
    for step in standard_trace(SMALL):
        driver.apply(step)
        if isinstance(step, AllocateSlots):
            request = driver.requests[step.request_id]
            # the engine's bookkeeping: every scheduled token is computed after the step
            scheduled[step.request_id] = scheduled.get(step.request_id, 0) + (
                step.num_new_computed_tokens + step.num_new_tokens)
            assert request.num_computed_tokens == scheduled[step.request_id] <= request.num_tokens
            final[step.request_id] = (request.num_computed_tokens, request.num_tokens)
    assert set(final.values()) == {(SMALL.max_tokens, SMALL.max_tokens)}
    assert driver.requests == {}
    assert manager.block_pool.get_num_free_blocks() == peak_blocks(SMALL)
    assert driver.calls["get_computed_blocks"] == 6 and driver.calls["free"] == 6
    assert driver.hit_tokens == 4 * 1024
    assert driver.manager_total_ns > 0 and driver.us_per_call("allocate_slots") > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_driver_reports_a_pool_too_small(implementation: str) -> None:
    manager = make_manager(implementation, num_blocks=peak_blocks(SMALL), hash_fn="xxh3_128")
    with pytest.raises(TraceError, match="refused"):
        TraceDriver(manager).run(standard_trace(SMALL))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_driver_reports_an_unexpected_hit(implementation: str) -> None:
    manager = make_manager(implementation, num_blocks=peak_blocks(SMALL) + 1, hash_fn="xxh3_128",
                           enable_caching=False)
    with pytest.raises(TraceError, match="expects 1024"):
        TraceDriver(manager).run(standard_trace(SMALL))


def test_make_manager_rejects_unknown_implementation() -> None:
    with pytest.raises(ValueError, match="implementation"):
        make_manager("fast")
