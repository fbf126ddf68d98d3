"""pagedkv.vllm's fast paths for vLLM's own ``Request`` answer as its general path:
the decode step (D-PERF-11), the admission snapshot (D-PERF-12), the core's
admission step called directly, full-sequence check included (D-PERF-19,
D-PERF-20), the one-group lookup and ``get_blocks`` (D-PERF-13).

``KVCacheManager.allocate_slots`` hands vLLM's own ``Request`` to the core's
decode step unwrapped; any other type (here a trivial subclass, identical in
every attribute) goes through the request view. Two managers run the same
workload, one on each kind of request, and must agree on every answer and on
the whole state after every call. Runs where vLLM is importable (the vLLM
venvs of ``make verify-vllm`` / ``make verify-engine``); skipped elsewhere.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

BLOCK = 16


def _config(window: bool, num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                                                           dtype=torch.float16))]
    if window:
        groups.append(KVCacheGroupSpec(["window"], SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=40)))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def count_core_calls(managers: list[Any]) -> list[int]:
    """Per manager, a count of its core ``allocate_slots`` calls (the adapter's general path), kept live."""
    core_calls = [0] * len(managers)
    for index, manager in enumerate(managers):
        inner = manager._core.allocate_slots

        def counted(*args: Any, _inner: Any = inner, _index: int = index, **kwargs: Any) -> Any:
            core_calls[_index] += 1
            return _inner(*args, **kwargs)
        manager._core.allocate_slots = counted
    return core_calls


def _ids(blocks: Any) -> Any:
    return None if blocks is None else blocks.get_block_ids()


@pytest.mark.parametrize("window", [False, True], ids=["full", "full+window"])
@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unwrapped_decode_steps_answer_as_the_view(window: bool, events: bool, seed: int) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make verify-vllm)")
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    import pagedkv.vllm

    class ViewedRequest(Request):  # type: ignore[misc]
        """Not exactly vLLM's Request: the adapter's general path, through the view."""

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    rng = random.Random(seed)
    # A small pool, so decode steps also run out of blocks (None) and fill blocks.
    managers: list[Any] = [pagedkv.vllm.KVCacheManager(_config(window, 48), 512, scheduler_block_size=BLOCK,
                                            hash_block_size=BLOCK, enable_kv_cache_events=events,
                                            log_stats=True)
                for _ in range(2)]
    core_calls = count_core_calls(managers)
    prefix = [rng.randrange(3, 500) for _ in range(2 * BLOCK)]
    live: list[tuple[Any, Any]] = []
    admissions = 0
    for number in range(24):
        if live and (rng.random() < 0.25 or len(live) >= 5):
            pair = live.pop(rng.randrange(len(live)))
            for manager, request in zip(managers, pair):
                manager.free(request)
        tokens = (prefix if rng.random() < 0.5 else []) + [rng.randrange(3, 500)
                                                          for _ in range(rng.randrange(1, 60))]
        made = [kind(f"r{number}", list(tokens), sampling_params=SamplingParams(max_tokens=64),
                     pooling_params=None, block_hasher=hasher) for kind in (Request, ViewedRequest)]
        pair = (made[0], made[1])
        lookups = [manager.get_computed_blocks(request) for manager, request in zip(managers, pair)]
        assert [(_ids(blocks), hit, boundary) for blocks, hit, boundary in lookups] == [
            (_ids(blocks), hit, boundary) for blocks, hit, boundary in lookups[:1]] * 2
        # The admission: the whole prompt, or a first chunk of it; with or without the
        # full-sequence check (the core's admission step counts it, D-PERF-19).
        rest = len(tokens) - lookups[0][1]
        chunk = rest if rng.random() < 0.5 else rng.randrange(1, rest + 1)
        whole = rng.random() < 0.5
        reserved = rng.choice([0, 0, 4, 16])  # blocks the scheduler holds back (D-API-13)
        answers = []
        admissions += 1
        for manager, request, (blocks, hit, _) in zip(managers, pair, lookups):
            new = manager.allocate_slots(request, chunk, hit, blocks, full_sequence_must_fit=whole,
                                         reserved_blocks=reserved)
            if new is not None and chunk < rest:
                request.num_computed_tokens = hit + chunk
                new = manager.allocate_slots(request, rest - chunk, full_sequence_must_fit=whole)
            answers.append((hit, _ids(new), _ids(manager.get_blocks(request.request_id))))
            if new is not None:
                request.num_computed_tokens = request.num_tokens
        assert answers[0] == answers[1]
        assert managers[0]._core.snapshot() == managers[1]._core.snapshot()
        if answers[0][1] is not None:
            live.append(pair)
        for _ in range(rng.randrange(1, 40)):
            for pair in live:
                answers = []
                for manager, request in zip(managers, pair):
                    answers.append(_ids(manager.allocate_slots(request, 1, num_lookahead_tokens=0)))
                assert answers[0] == answers[1]
                if answers[0] is not None:
                    token = rng.randrange(3, 500)
                    for request in pair:
                        request.append_output_token_ids(token)
                        request.num_computed_tokens += 1
                assert managers[0]._core.snapshot() == managers[1]._core.snapshot()
            for manager in managers:
                manager.new_step_starts()
            taken = [manager.take_events() for manager in managers]
            assert len(taken[0]) == len(taken[1])
    # The fast paths ran: the unwrapped manager settled a good part of its decode steps without the
    # core's allocate_slots (a sliding window's releases take the general path more often); with
    # events on, decode steps take the view's path on both, and only admissions on one
    # full-attention group (the core's admission step, D-PERF-20) skip the core's allocate_slots.
    if events:
        assert core_calls[1] - core_calls[0] == (0 if window else admissions), (core_calls, admissions)
    else:
        assert core_calls[0] * 4 < core_calls[1] * 3
