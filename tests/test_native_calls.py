"""The one-group manager's calls in C (D-PERF-49) against the Python code
they stand in for.

``_native.lookup`` (``get_computed_blocks`` after its checks) and
``_native.release_request``
(``UnitaryCoordinator.release``) promise the Python code's results, state
and errors, and to hand back, before any change, whatever they do not
cover. Twin managers run the same random engine script here: one with the
C calls installed (a native build's default), the other with the Python
method and release (both admit through the same admission step). After every call both must give the same answer
(or the same error) and the same observable state, pool lists included.
The lockstep machines hold the native build to the reference as well.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import pytest

from pagedkv.optimized import KVCacheBlocks, KVCacheManager
from pagedkv.optimized.native import NATIVE
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request

needs_native = pytest.mark.skipif(NATIVE is None, reason="built without the C module")


def _config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(),
                         kv_cache_groups=(KVCacheGroupSpec(("layer0",), spec),))


def _interpreted(manager: KVCacheManager) -> KVCacheManager:
    """The manager with the Python code in place of each C call."""
    manager._lookup = None
    manager._release = manager.coordinator.release
    return manager


def _state(manager: KVCacheManager) -> tuple[Any, ...]:
    pool = manager.block_pool
    queue = pool._queue
    return (manager.snapshot(), list(pool._ref), list(pool._hash), list(pool._gid), list(pool._key_tokens),
            queue.to_list(), queue.size, [dict(t) for t in pool.cached_by_group], pool.map_epoch,
            dict(manager.coordinator.managers[0].req_to_blocks),
            dict(manager.coordinator.managers[0].num_cached_blocks))


def _answer(call: Any) -> Any:
    try:
        result = call()
    except Exception as error:  # the same typed error, same message, from both
        return ("raised", type(error).__name__, str(error))
    if isinstance(result, tuple) and result and isinstance(result[0], KVCacheBlocks):
        return ("hit", result[0].get_block_ids(), result[1])
    if isinstance(result, KVCacheBlocks):
        return ("blocks", result.get_block_ids())
    return result


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_c_calls_equal_the_python_code(seed: int) -> None:
    rng = random.Random(seed)
    pool_size = rng.choice([12, 24, 40])
    native = KVCacheManager(_config(pool_size), 96)
    python = _interpreted(KVCacheManager(_config(pool_size), 96))
    twins = (native, python)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    live: dict[str, tuple[Request, Request]] = {}
    for number in range(300):
        action = rng.random()
        if live and action < 0.35:
            request_id = rng.choice(sorted(live))
            pair = live.pop(request_id)
            answers = [_answer(partial(m.free, r)) for m, r in zip(twins, pair)]
        elif action < 0.4:  # unknown, or not a str: the method's typed error (or missing_ok)
            odd: Any = rng.choice(["ghost", 7, None])
            who = Request("ghost", [1], block_hasher=None) if odd == "ghost" else type("R", (), {"request_id": odd})()
            missing_ok = rng.random() < 0.5
            answers = [_answer(partial(m.free, who, missing_ok=missing_ok)) for m in twins]
        else:
            request_id = f"r{number}"
            prompt = rng.choice(prefixes)[: rng.randrange(1, 30)] + [rng.randrange(5)
                                                                      for _ in range(rng.randrange(0, 12))]
            pair = (native.make_request(request_id, prompt), python.make_request(request_id, prompt))
            looked = [_answer(partial(m.get_computed_blocks, r)) for m, r in zip(twins, pair)]
            assert looked[0] == looked[1], (number, looked)
            hits = [m.get_computed_blocks(r) for m, r in zip(twins, pair)]
            kwargs: dict[str, Any] = {
                "delay_cache_blocks": rng.random() < 0.2, "reserved_blocks": rng.choice([0, 0, 1, 3]),
                "watermark_blocks": rng.choice([0, 0, 2]), "full_sequence_must_fit": rng.random() < 0.3}
            chunk = rng.choice([None, 1, 4])
            stale = rng.random() < 0.1  # a hit passed back after another lookup: the memo does not vouch
            if stale:
                for m in twins:
                    m.get_computed_blocks(m.make_request(f"other{number}", rng.choice(prefixes)))
            pass_hit = rng.random() < 0.5  # an empty hit passed, or None
            answers = []
            for (m, r), (hit, num_hit) in zip(zip(twins, pair), hits):
                new = len(prompt) - num_hit if chunk is None else min(chunk, len(prompt) - num_hit)
                answers.append(_answer(partial(m.allocate_slots, r, new, num_hit,
                                               hit if num_hit or pass_hit else None, **kwargs)))
            if answers[0] is not None and answers[0][0] == "blocks":
                live[request_id] = pair
        assert answers[0] == answers[1], (number, answers)
        assert _state(native) == _state(python), number
        native.check_invariants()


@needs_native
def test_c_calls_are_installed_and_hand_back_what_they_do_not_cover() -> None:
    manager = KVCacheManager(_config(16), 64)
    assert manager._lookup is not None and isinstance(manager._release, partial)
    # The lookup declines a request whose token count is not an exact int: the method's code runs.
    request = manager.make_request("a", list(range(12)))

    class Odd:
        request_id = "a"
        block_hashes = request.block_hashes
        num_tokens = 12.0
        skip_reading_prefix_cache = False
        num_preemptions = 0

    odd: Any = Odd()
    assert manager._lookup(odd) is None
    # The release hands an unknown id to the method, which raises its KeyError.
    with pytest.raises(KeyError):
        manager._release("nobody")
    # With statistics on, the lookup is the method's (it records the lookup).
    counted = KVCacheManager(_config(16), 64, log_stats=True)
    counted.get_computed_blocks(counted.make_request("b", list(range(12))))
    stats = counted.make_prefix_cache_stats()
    assert stats is not None and stats.requests == 1
