"""pagedkv.vllm's ``allocate_slots`` hands a decode step of vLLM's own
``Request`` to the core's decode step (no copy of it in the adapter), and its
per-step drains skip calls that can find nothing (D-PERF-32); every answer is
the one the core's general path gives.

Here vLLM's ``Request`` (the core's decode step, unwrapped) and a trivial
subclass of it (the request view and the core's general path) run the same
decode calls on two managers,
over every edge of the branch: the request's last held slot, one past it,
max_model_len, a block filled with caching on and off, ``delay_cache_blocks``,
an unknown request. Runs where vLLM is importable; skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_vllm_decode_fast_path import BLOCK, _ids, count_core_calls
from tests.test_vllm_decode_fast_path import _config as decode_fast_path_config


def _config(num_blocks: int, window: bool = False) -> Any:
    return decode_fast_path_config(window, num_blocks)


def _pair(caching: bool, max_model_len: int = 96, window: bool = False) -> tuple[list[Any], list[int]]:
    import pagedkv.vllm

    managers = [pagedkv.vllm.KVCacheManager(_config(24, window), max_model_len, scheduler_block_size=BLOCK,
                                            hash_block_size=BLOCK, enable_caching=caching)
                for _ in range(2)]
    core_calls = count_core_calls(managers)
    return managers, core_calls


def _requests(number: int, tokens: list[int]) -> tuple[Any, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    class ViewedRequest(Request):  # type: ignore[misc]
        """Not exactly vLLM's Request: the adapter's general path, through the view."""

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    made = [kind(f"r{number}", list(tokens), sampling_params=SamplingParams(max_tokens=64),
                 pooling_params=None, block_hasher=hasher) for kind in (Request, ViewedRequest)]
    return made[0], made[1]


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("delay", [False, True], ids=["cache-now", "delay-cache"])
def test_decode_steps_answer_as_the_general_path(caching: bool, delay: bool) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make verify-vllm)")
    managers, core_calls = _pair(caching)
    number = 0
    # Prompts ending anywhere in a block; each request decodes past its held slots,
    # asking for 1..3 tokens (a chunk or speculative tokens), up to and over max_model_len.
    for length in (1, 15, 16, 17, 31, 40, 47, 48, 80, 95):
        for asked in (1, 2, 3):
            number += 1
            pair = _requests(number, list(range(3, 3 + length)))
            first = [_ids(manager.allocate_slots(request, length, 0, manager.empty_kv_cache_blocks))
                     for manager, request in zip(managers, pair)]
            assert first[0] == first[1]
            if first[0] is None:
                continue
            for request in pair:
                request.num_computed_tokens = length
            for _ in range(40):
                answers = []
                for manager, request in zip(managers, pair):
                    try:
                        answers.append(_ids(manager.allocate_slots(
                            request, asked, num_lookahead_tokens=0, delay_cache_blocks=delay)))
                    except Exception as error:  # max_model_len: both must refuse alike
                        answers.append(type(error).__name__)
                assert answers[0] == answers[1], (length, asked, pair[0].num_computed_tokens)
                assert managers[0]._core.snapshot() == managers[1]._core.snapshot()
                if answers[0] is None or isinstance(answers[0], str):
                    break
                for request in pair:
                    request.num_computed_tokens += 1
                    request.append_output_token_ids(7)
            for manager, request in zip(managers, pair):
                manager.free(request)
    # The core's decode step answered calls without the general path; the subclass never skipped it.
    assert core_calls[0] < core_calls[1]


def test_unknown_request_and_a_dropped_step_take_the_general_path() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make verify-vllm)")
    from pagedkv.spec.errors import InvalidArgumentError

    managers, core_calls = _pair(True)
    manager = managers[0]
    request, _ = _requests(1, list(range(3, 23)))
    request.num_computed_tokens = 20
    # Unknown, with tokens computed: the core's general path refuses it, as for the view.
    with pytest.raises(InvalidArgumentError) as raised:
        manager.allocate_slots(request, 1)
    other = managers[1]
    _, viewed = _requests(1, list(range(3, 23)))
    viewed.num_computed_tokens = 20
    with pytest.raises(InvalidArgumentError) as expected:
        other.allocate_slots(viewed, 1)
    assert str(raised.value) == str(expected.value)
    assert manager._core.snapshot() == other._core.snapshot()
    # Freeing an unknown request is a no-op on both paths (D-PERF-34 frees vLLM's Request itself).
    manager.free(request)
    other.free(viewed)
    assert manager._core.snapshot() == other._core.snapshot()
    # A coordinator whose decode step was dropped (as sub-block hits drop it) is not
    # answered from the stale tables: every call reaches the core's allocate_slots.
    known, _ = _requests(2, list(range(3, 23)))
    assert manager.allocate_slots(known, 20, 0, manager.empty_kv_cache_blocks) is not None
    known.num_computed_tokens = 20
    manager._core_coordinator.decode_step = None
    before = core_calls[0]
    assert manager.allocate_slots(known, 1, num_lookahead_tokens=0) is not None
    assert core_calls[0] == before + 1


def test_the_adapter_calls_the_cores_one_decode_step() -> None:
    """The adapter keeps no copy of the step: every plain decode call of vLLM's
    Request reaches the coordinator's decode_step, single group or hybrid."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make verify-vllm)")
    import pagedkv.vllm

    for window in (False, True):
        manager = pagedkv.vllm.KVCacheManager(_config(24, window=window), 96, scheduler_block_size=BLOCK,
                                              hash_block_size=BLOCK)
        coordinator = manager._core.coordinator
        step = coordinator.decode_step
        assert step is not None
        calls = [0]

        def counted(*args: Any, _step: Any = step, _calls: list[int] = calls) -> Any:
            _calls[0] += 1
            return _step(*args)
        coordinator.decode_step = counted
        request, _ = _requests(1, list(range(3, 23)))
        assert manager.allocate_slots(request, 20, 0, manager.empty_kv_cache_blocks) is not None
        request.num_computed_tokens = 20
        calls[0] = 0  # the admission may reach the step too (the core's allocate_slots offers it first)
        for _ in range(5):
            request.append_output_token_ids(7)
            assert manager.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
        assert calls[0] == 5, window


def test_per_step_drains_answer_as_the_core() -> None:
    """The drains that skip a call (D-PERF-32) give what the call would give: fresh
    empty results each step, and a Mamba-free coordinator offers no boundary state."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make verify-vllm)")
    managers, _ = _pair(True)
    manager = managers[0]
    assert not manager._has_step_hooks and manager._records_no_zeroing
    manager.new_step_starts()
    first, second = manager.take_new_block_ids(), manager.take_new_block_ids()
    assert first == second == [] and first is not second
    assert manager.take_boundary_state_offloads() == manager._core.take_boundary_state_offloads() == {}
    offloads = manager.take_boundary_state_offloads()
    offloads["x"] = []
    assert manager.take_boundary_state_offloads() == {}
