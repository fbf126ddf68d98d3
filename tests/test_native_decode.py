"""The optional C no-op test of the several-group decode step
(``optimized/_decode.c``, D-PERF-39) against :func:`decode.is_noop_decode`,
the Python definition.

Hybrid managers of every probed group type are driven through random decode
steps; at every state the C test must give the Python test's answer for a
spread of step shapes (tokens computed, total, tokens to cache), or ``None``
where it does not cover the arguments (then the Python test runs). Skipped,
with the reason, in a build without a C compiler.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import pytest

from pagedkv.optimized import KVCacheManager
from pagedkv.optimized.native import DECODE
from pagedkv.optimized.paths.decode import decode_probes, is_noop_decode, native_rules
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH
from pagedkv.spec import KVCacheConfig, KVCacheGroupSpec
from tests.test_fill_path import _spec

needs_decode = pytest.mark.skipif(DECODE is None, reason="built without the C module (no C compiler, "
                                  "or PAGEDKV_PURE_PYTHON=1): the Python test runs, nothing to compare")

KINDS = [("full",), ("sliding", "sliding", "full"), ("full", "chunked"), ("full", "mamba-align"),
         ("full", "mamba-align:1"), ("full", "mamba-all:1"), ("sliding", "mamba-none"), ("full", "ring"), ("chunked",)]


@needs_decode
@pytest.mark.parametrize("kinds", KINDS, ids=" ".join)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize(("block_size", "window", "chunk"), [(4, 6, 8), (2, 5, 6), (3, 7, 12)])
def test_native_noop_is_is_noop_decode(kinds: tuple[str, ...], caching: bool, block_size: int, window: int,
                                       chunk: int) -> None:
    assert DECODE is not None
    rng = random.Random(repr((kinds, caching, block_size)))
    config = KVCacheConfig(160, (), tuple(KVCacheGroupSpec((f"layer.{i}",), _spec(kind, block_size, window, chunk))
                                          for i, kind in enumerate(kinds)))
    manager = KVCacheManager(config, 256, enable_caching=caching)
    probes = decode_probes(manager.coordinator.managers)
    assert probes is not None
    rules = native_rules(manager.coordinator.managers, probes)
    assert rules is not None
    request = manager.make_request("a", [rng.randrange(5) for _ in range(rng.randrange(1, 9))])
    assert manager.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    answers = set()
    for _ in range(70):
        computed = request.num_computed_tokens
        for num_new in (1, 2, 5):
            for cache_tokens in (-1, computed + num_new, computed + num_new - 1, 0):
                for request_id in ("a", "unknown"):
                    ours = DECODE.noop(rules, request_id, computed, computed + num_new, cache_tokens)
                    if request_id == "unknown":
                        assert ours is None  # the Python test hands an unknown request on
                        continue
                    assert ours == is_noop_decode(probes, request_id, computed, computed + num_new, cache_tokens)
                    answers.add(ours)
        request.append_output_token_ids(rng.randrange(5))
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    # Both answers given (at block size 2 a Mamba group has work nearly every step).
    assert answers == {True, False} or (block_size == 2 and answers == {False})


@needs_decode
def test_native_noop_refuses_what_it_does_not_cover() -> None:
    assert DECODE is not None
    config = KVCacheConfig(40, (), (KVCacheGroupSpec(("a",), _spec("sliding")),
                                    KVCacheGroupSpec(("b",), _spec("full"))))
    manager = KVCacheManager(config, 64)
    request = manager.make_request("a", [1, 2, 3])
    assert manager.allocate_slots(request, 3) is not None
    probes = decode_probes(manager.coordinator.managers)
    assert probes is not None
    rules = native_rules(manager.coordinator.managers, probes)
    assert rules is not None
    assert DECODE.noop(rules, "a", 3, 4, 4) is not None  # covered
    odd: list[tuple[Any, ...]] = [
        (rules, 7, 3, 4, 4), (rules, "a", 3.0, 4, 4), (rules, "a", 3, 2**80, 4), (rules, "a", True, 4, 4),
        (list(rules), "a", 3, 4, 4), (((*rules[0][:5], 9, 0, None),) + rules[1:], "a", 3, 4, -1),
        (((*rules[0][:2], 0, *rules[0][3:]),), "a", 3, 4, 4),
    ]
    for args in odd:
        assert DECODE.noop(*args) is None, args


def _odd_request(request: Any, drop: str) -> Any:
    """A stand-in of ``request`` without attribute ``drop`` (an engine's
    object short of one): the step's AttributeError rules decide."""
    names = ("request_id", "num_computed_tokens", "num_tokens", "block_hashes", "all_token_ids")
    return type("Odd", (), {name: getattr(request, name) for name in names if name != drop})()


@needs_decode
@pytest.mark.parametrize("kinds", KINDS, ids=" ".join)
@pytest.mark.parametrize("caching", [True, False])
def test_c_decode_step_is_the_python_step(kinds: tuple[str, ...], caching: bool) -> None:
    """The probed step in C (D-PERF-50) against the Python step it stands in
    for: twin managers, the same decode steps, the same answers (the shared
    empty result, blocks, the general path, or the same error) and states."""
    rng = random.Random(repr((kinds, caching, "step")))
    config = KVCacheConfig(60, (), tuple(KVCacheGroupSpec((f"layer.{i}",), _spec(kind, 4, 6, 8))
                                         for i, kind in enumerate(kinds)))
    # max_model_len 46 (not a whole number of blocks): the script's requests reach it (past it:
    # the general path), and a step past it may still fit the last block.
    twins = [KVCacheManager(config, 46, enable_caching=caching) for _ in range(2)]
    c_step, installed = (manager.coordinator.decode_step for manager in twins)
    assert isinstance(c_step, partial) and isinstance(installed, partial), "a native build installs the C step"
    python_step = installed.args[0][0]  # the second twin's own Python step
    twins[1].coordinator.decode_step = python_step
    steps = [c_step, python_step]
    pairs = []
    for index in range(3):
        prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        pair = [manager.make_request(f"r{index}", prompt) for manager in twins]
        for manager, request in zip(twins, pair):
            assert manager.allocate_slots(request, request.num_tokens) is not None
            request.num_computed_tokens = request.num_tokens
        pairs.append(pair)
    empty_answers = 0
    for number in range(200):
        pair = rng.choice(pairs)
        count = rng.choice([1, 1, 1, 2, 3])
        delay = rng.random() < 0.2
        odd = rng.random() < 0.1
        drop = rng.choice(["request_id", "num_computed_tokens", "num_tokens", "block_hashes"])
        answers: list[Any] = []
        for manager, step, request in zip(twins, steps, pair):
            subject = _odd_request(request, drop) if odd else request
            try:
                result = step(subject, count, delay)
            except AttributeError as error:
                answers.append(("raised", str(error)))
                continue
            if result is manager.coordinator.empty_blocks:
                answers.append("empty")
            elif result is TAKE_GENERAL_PATH or result is None:
                answers.append(result)
            else:
                answers.append(("blocks", result.get_block_ids()))
        assert answers[0] == answers[1], (number, answers)
        empty_answers += answers[0] == "empty"
        assert twins[0].snapshot() == twins[1].snapshot(), number
        if answers[0] not in (None, TAKE_GENERAL_PATH) and not odd and answers[0][0] != "raised":
            tokens = [rng.randrange(5) for _ in range(count)]
            for request in pair:  # the step's tokens are computed; more to come
                request.num_computed_tokens += count
                request.append_output_token_ids(tokens)
    assert empty_answers >= 20, empty_answers  # the C no-op branch ran
