"""The admission fast path (``optimized/paths/admit_path.py``, D-PERF-17) against
the general path it shortcuts.

Twin optimized managers run the same engine script; one has its
coordinator's ``admit_step`` switched off, so every admission goes through
the spec's steps (``validation.allocate_args`` and the per-group dispatch).
After every call both must agree on the result, the typed error (type and
message), the observable state, the key token counts (KEYTOK-1) and the
events. The script admits requests sharing prefixes in a small pool (hits
on free and on held blocks, eviction, refusals) with prefix hits passed
back untouched, stale (evicted since the lookup), reshaped or malformed,
chunked prefills, delayed caching, headroom (``reserved_blocks`` and
``watermark_blocks``, D-API-48) and in-flight counts; the differential
machines hold both to the reference.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest

from pagedkv.optimized import KVCacheBlocks, KVCacheManager
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request
from pagedkv.spec.request import RequestFacts
from pagedkv.spec.types import BlockHash
from tests.faults import LineFuse


def _config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(),
                         kv_cache_groups=(KVCacheGroupSpec(("layer0",), spec),))


def _key_tokens(manager: KVCacheManager) -> list[int | None]:
    pool = manager.block_pool
    return [pool.key_tokens(block) for block in range(pool.num_blocks)]


def _tamper(hit: KVCacheBlocks, num_hit: int, rng: random.Random,
            pool_size: int) -> tuple[Any, Any]:
    """A malformed variant of a hit and its token count (both twins get the same)."""
    blocks = hit.blocks[0]
    kind = rng.randrange(9)
    if kind == 0:
        return KVCacheBlocks(([*blocks, rng.randrange(pool_size)],), []), num_hit  # 1f: too many
    if kind == 1 and blocks:
        return KVCacheBlocks((blocks[:-1],), []), num_hit  # 1f: too few
    if kind == 2 and blocks:
        return KVCacheBlocks(([*blocks[:-1], blocks[-1] % (pool_size - 1) + 1],), []), num_hit  # 1i
    if kind == 3 and blocks:
        return KVCacheBlocks(([True, *blocks[1:]],), []), num_hit  # 1h: not an int
    if kind == 4:
        return KVCacheBlocks((list(blocks), []), []), num_hit  # 1c: two groups
    if kind == 5:
        return blocks, num_hit  # 1c: not KVCacheBlocks
    if kind == 6:
        return hit, float(num_hit)  # 1b: not an int
    if kind == 7:
        return hit, num_hit + 4  # 1f: disagrees with the blocks
    return KVCacheBlocks(([pool_size + 3, *blocks[1:]],), []), num_hit  # 1h: outside the pool


def _call(manager: KVCacheManager, request: Request, args: dict[str, Any]) -> object:
    try:
        result = manager.allocate_slots(request, **args)
    except Exception as error:  # the same typed error, same message, from both
        return (type(error).__name__, str(error))
    return None if result is None else result.get_block_ids()


def _python_step(manager: KVCacheManager) -> Any:
    """The manager's admission step (Python in every build: the C admission
    step of D-PERF-49 is gone, only its pool work is one C call)."""
    step = manager.coordinator.admit_step
    assert step is not None
    return step


STEPS = ["installed"]
"""Which admission step a test drives: the installed one (Python in every
build since the C admission step went; the pool work under it is one C call
in a native build)."""


@pytest.mark.parametrize("which", STEPS)
@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_admission_step_equals_the_general_path(events: bool, seed: int, which: str) -> None:
    rng = random.Random(seed)
    pool_size = 40
    twins = [KVCacheManager(_config(pool_size), 64, enable_kv_cache_events=events) for _ in range(2)]
    fast, general = twins
    step = fast.coordinator.admit_step if which == "installed" else _python_step(fast)
    assert step is not None
    general.coordinator.admit_step = None
    settled = 0

    raw_turns = random.Random(seed + 1000)

    def counting(*args: Any, **kwargs: Any) -> Any:
        # Half the calls go raw, as pagedkv.vllm calls the step (D-PERF-34): the hit's
        # one group of ids in, the new blocks' ids out; the answer must be the same.
        nonlocal settled
        hit = args[3]
        if raw_turns.random() < 0.5 and (hit is None or (type(hit) is KVCacheBlocks and len(hit.blocks) == 1)):
            call_raw: Any = step  # the arguments pass through as they came
            raw = call_raw(*args[:3], None if hit is None else hit.blocks[0], *args[4:], raw=True)
            result = KVCacheBlocks((raw,), fast.block_pool.block_hashes) if isinstance(raw, list) else raw
        else:
            result = step(*args, **kwargs)
        settled += result is not TAKE_GENERAL_PATH
        return result

    fast.coordinator.admit_step = counting
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    live: dict[str, list[Request]] = {}
    for number in range(400):
        action = rng.random()
        if live and action < 0.25:
            request_id = rng.choice(sorted(live))
            for manager, request in zip(twins, live.pop(request_id)):
                manager.free(request)
        elif live and action < 0.4:
            # A decode or prefill step of a known request (the general path
            # for a known request with a hit argument: it is refused there).
            request_id = rng.choice(sorted(live))
            pair = live[request_id]
            num_new = rng.randrange(1, 6)
            with_empty_hit = rng.random() < 0.2  # vLLM passes an empty hit object
            outcomes = [_call(manager, request, {"num_new_tokens": num_new, "new_computed_blocks":
                                                 manager.coordinator.empty_blocks if with_empty_hit else None})
                        for manager, request in zip(twins, pair)]
            assert outcomes[0] == outcomes[1], (number, outcomes)
            if isinstance(outcomes[0], tuple) and not isinstance(outcomes[0][0], str):
                for request in pair:
                    request.num_computed_tokens += num_new
                    request.append_output_token_ids(1)
        else:
            request_id = f"r{number}"
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            pair = [manager.make_request(request_id, prompt) for manager in twins]
            hits = [manager.get_computed_blocks(request) for manager, request in zip(twins, pair)]
            assert hits[0][0].get_block_ids() == hits[1][0].get_block_ids()
            if rng.random() < 0.15:  # make the hit stale: evict one of its blocks
                blocks = hits[0][0].blocks[0]
                if blocks:
                    victim = rng.choice(blocks)
                    for manager in twins:
                        manager.evict_blocks([victim])
            num_hit = hits[0][1]
            remaining = len(prompt) - num_hit
            chunk = rng.randrange(1, remaining + 1) if rng.random() < 0.5 else remaining
            args: dict[str, Any] = {"num_new_tokens": chunk, "delay_cache_blocks": rng.random() < 0.15}
            if rng.random() < 0.2:
                args["reserved_blocks"] = rng.choice([0, 1, 5, 30, -1, 2.0])
            if rng.random() < 0.2:  # the engine's watermark (D-API-48)
                args["watermark_blocks"] = rng.choice([0, 1, 5, 30, -1, 2.0])
            if rng.random() < 0.1:
                args["num_in_flight_tokens"] = rng.choice([0, 3, -2])
            if rng.random() < 0.3:  # the whole request must fit too (vLLM's admission), or a truthy non-bool
                args["full_sequence_must_fit"] = rng.choice([True, True, True, False, 1])
            if rng.random() < 0.1:  # past the prompt (a drafter's tokens), or malformed
                args["num_new_tokens"] = rng.choice([remaining + 1, remaining + 6, 0, -1, 1.0, 100])
            if rng.random() < 0.1:  # a lagging hasher: fewer hashes than full blocks (D-API-11)
                keep = rng.randrange(len(pair[0].block_hashes) + 1)
                for request in pair:
                    del request.block_hashes[keep:]
            elif rng.random() < 0.05:  # a foreign view with hashes past its tokens: caching stops at the tokens
                for request in pair:
                    request.block_hashes.append(BlockHash(bytes([number % 256]) * 32))
            if rng.random() < 0.1:
                computed = rng.choice([2, -1])
                for request in pair:
                    request.num_computed_tokens = computed
            tampered = rng.random() < 0.15
            without_hit = not num_hit and rng.random() < 0.2  # None for the hit object
            outcomes = []
            for manager, request, (hit, num) in zip(twins, pair, hits):
                hit_arg: Any = None if without_hit else hit
                if tampered:  # the same tampering for both twins
                    hit_arg, num = _tamper(hit, num, random.Random(seed * 1000 + number), pool_size)
                call_args = {**args, "new_computed_blocks": hit_arg, "num_new_computed_tokens": num}
                outcomes.append(_call(manager, request, call_args))
            assert outcomes[0] == outcomes[1], (number, args, outcomes)
            if isinstance(outcomes[0], tuple) and not isinstance(outcomes[0][0], str):
                for request in pair:
                    request.num_computed_tokens = num_hit + args["num_new_tokens"]
                live[request_id] = pair
        assert fast.snapshot() == general.snapshot(), number
        assert _key_tokens(fast) == _key_tokens(general), number
        assert fast.take_events() == general.take_events(), number
        fast.check_invariants()
    assert settled >= 60, settled


def _twins(num_blocks: int, max_model_len: int = 64) -> tuple[KVCacheManager, KVCacheManager]:
    fast, general = (KVCacheManager(_config(num_blocks), max_model_len) for _ in range(2))
    general.coordinator.admit_step = None
    return fast, general


def _admit_both(twins: tuple[KVCacheManager, KVCacheManager], prompt: list[int], *, settle: bool = True,
                use_hit: bool = True, **args: Any) -> tuple[object, list[Request]]:
    """Admit ``prompt`` as a new request in both twins (its hit looked up):
    the fast twin's step must settle it (``settle``), with the general twin's
    result and state."""
    fast, general = twins
    request_id = f"q{len(fast.coordinator.requests)}-{len(prompt)}-{sorted(args.items())}"
    outcomes = []
    requests = []
    for manager in twins:
        request = manager.make_request(request_id, prompt)
        requests.append(request)
        hit, num_hit = manager.get_computed_blocks(request)
        call = {"num_new_computed_tokens": num_hit, "new_computed_blocks": hit if use_hit else None, **args}
        call.setdefault("num_new_tokens", len(prompt) - num_hit)
        if manager is fast:
            step = manager.coordinator.admit_step
            assert step is not None
            facts = RequestFacts(request)
            result = step(facts, call.pop("num_new_tokens"), call.pop("num_new_computed_tokens"),
                          call.pop("new_computed_blocks"), call.pop("delay_cache_blocks", False),
                          call.pop("reserved_blocks", 0), call.pop("watermark_blocks", 0),
                          call.pop("num_in_flight_tokens", 0), call.pop("full_sequence_must_fit", False))
            assert (result is not TAKE_GENERAL_PATH) == settle, (prompt, args)
            if result is TAKE_GENERAL_PATH:
                result = manager.allocate_slots(request, **{
                    "num_new_tokens": len(prompt) - num_hit, "num_new_computed_tokens": num_hit,
                    "new_computed_blocks": hit if use_hit else None, **args})
        else:
            result = manager.allocate_slots(request, **call)
        outcomes.append(None if result is None else result.get_block_ids())
    assert outcomes[0] == outcomes[1]
    assert fast.snapshot() == general.snapshot()
    assert _key_tokens(fast) == _key_tokens(general)
    fast.check_invariants()
    return outcomes[0], requests


def test_admission_step_settles_every_well_formed_new_request() -> None:
    """Boundary cases the step must settle itself (not hand back), each
    equal to the general path: one new token, no hit object, an empty hit
    object, a hit on every hashed block, max_model_len reached exactly,
    headroom and in-flight counts, delayed caching, tokens past the prompt,
    a demand equal to the free queue, a refusal (``None``) one block short,
    and a hit held by another request (counted exactly only when needed)."""
    twins = _twins(40, max_model_len=24)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    _admit_both(twins, prefix + [9], num_new_tokens=1, use_hit=False)
    _admit_both(twins, [5], use_hit=False)  # one token
    _admit_both(twins, [7] * 5, use_hit=False)
    empty = twins[0].coordinator.empty_blocks
    assert _admit_both(twins, [6] * 6, num_new_tokens=6, new_computed_blocks=empty)[0] is not None
    _admit_both(twins, prefix + [9])  # hit: both blocks of the prefix, the request's every hash
    _admit_both(twins, prefix + [5] * 16)  # main == max_model_len (8 hit + 16 new)
    _admit_both(twins, prefix + [4], reserved_blocks=1, num_in_flight_tokens=3)
    _admit_both(twins, prefix + [1], reserved_blocks=1, watermark_blocks=2, full_sequence_must_fit=True)
    _admit_both(twins, prefix + [3, 3], delay_cache_blocks=True)
    _admit_both(twins, prefix + [2], num_new_tokens=9)  # 8 + 9 > 9 tokens: caching stops at the prompt
    # Demand against the free queue, exactly: a pool of 1 + 6 blocks; the
    # second request hits the first's 2 blocks and needs 4 new ones.
    for holder_freed in (False, True):
        for short in (0, 1):
            twins = _twins(7)
            outcome, holders = _admit_both(twins, [3] * 8)  # 2 blocks, cached
            assert outcome is not None
            if holder_freed:  # the hit blocks are free: they count in the demand
                for manager, holder in zip(twins, holders):
                    manager.free(holder)
            outcome, _ = _admit_both(twins, [3] * 8 + [4] * 13, reserved_blocks=short)
            assert (outcome is None) == bool(short), (holder_freed, short)
    # The whole request must fit (D-PERF-19): a chunk of 4 tokens needs 1 new
    # block, the whole 21-token request 4 beyond its 2 hit blocks, which are
    # free or held: 4 blocks to spare either way. The chunk fits with a
    # reserved block and a watermark block kept; the whole request keeps
    # the watermark but not the reserved block (D-API-48), so it fits unless
    # a watermark block is kept.
    for holder_freed in (False, True):
        for reserved in (0, 1):
            for watermark in (0, 1):
                for whole in (False, True):
                    twins = _twins(7)
                    outcome, holders = _admit_both(twins, [3] * 8)
                    if holder_freed:
                        for manager, holder in zip(twins, holders):
                            manager.free(holder)
                    outcome, _ = _admit_both(twins, [3] * 8 + [4] * 13, num_new_tokens=4,
                                             reserved_blocks=reserved, watermark_blocks=watermark,
                                             full_sequence_must_fit=whole)
                    assert (outcome is None) == (whole and bool(watermark)), (
                        holder_freed, reserved, watermark, whole)
    # The step's demand keeps both: the chunk (1 block) with 3 reserved and 1
    # watermark block needs 5 of the 4 free, with 3 + 0 it fits exactly.
    for watermark in (0, 1):
        twins = _twins(7)
        _admit_both(twins, [3] * 8)
        outcome, _ = _admit_both(twins, [3] * 8 + [4] * 13, num_new_tokens=4, reserved_blocks=3,
                                 watermark_blocks=watermark)
        assert (outcome is None) == bool(watermark), watermark
    # Past max_model_len the whole request counts at max_model_len, as the
    # general path caps it: 6 blocks of the 7 free, not 8.
    twins = _twins(8, max_model_len=24)
    outcome, _ = _admit_both(twins, [6] * 30, num_new_tokens=8, use_hit=False, full_sequence_must_fit=True)
    assert outcome is not None


@pytest.mark.parametrize("which", STEPS)
def test_admission_step_recovers_from_a_fault_at_every_line(which: str) -> None:
    """An exception at any line the fast admission runs (KeyboardInterrupt,
    MemoryError: the line tracer of ``tests.faults``) leaves a consistent
    manager: the invariants hold and freeing every request it knows gives
    back every block (D-API-24). The C step runs few Python lines (the
    facade's, the request's properties); its own faults after a change are
    test_c_admission_step_recovers_from_a_fault_after_a_change's."""
    fired = 0
    for fire_at in range(1, 1000):
        manager = KVCacheManager(_config(24), 64)
        if which == "python":
            manager.coordinator.admit_step = _python_step(manager)
        holder = manager.make_request("holder", list(range(12)))
        assert manager.allocate_slots(holder, 12) is not None
        holder.num_computed_tokens = 12
        manager.free(holder)  # its 3 blocks: cached and free
        request = manager.make_request("new", list(range(12)) + [9] * 9)
        hit, num_hit = manager.get_computed_blocks(request)
        assert num_hit == 12
        fuse = LineFuse(fire_at, KeyboardInterrupt if fire_at % 2 else MemoryError)
        raised = False
        sys.settrace(fuse.global_trace)
        try:
            manager.allocate_slots(request, 9, num_hit, hit)
        except (KeyboardInterrupt, MemoryError):
            raised = True
        finally:
            sys.settrace(None)
        assert raised == (fuse.count >= fire_at), fire_at  # the fault reaches the caller
        fired += raised
        manager.check_invariants()
        for request_id in [r.request_id for r in manager.snapshot().requests]:
            manager.free(request if request_id == "new" else holder)
        assert manager.block_pool.get_num_free_blocks() == 23
        if fuse.count < fire_at:  # ran to the end without firing: every line tried
            break
    assert fired >= 20
