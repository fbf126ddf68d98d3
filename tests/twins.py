"""Twin managers: one with a fast path, one with it switched off, driven alike.

The decode fast paths of the optimized coordinator (``decode_path``,
``fill_path``) must do exactly what the general path does. A test builds two
managers from the same configuration, switches the fast path off in the
second, and hands both to :func:`drive_twins`: random admissions, frees and
steps (several tokens at once, fewer tokens appended than scheduled, delayed
caching, malformed counts), the same on both, and after every step the same
result or error type, the same snapshot and the same events.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.optimized import KVCacheManager
from pagedkv.spec import Request

__all__ = ["FastStep", "drive_twins"]

FastStep = Callable[[KVCacheManager, Request, int, bool], Any]
"""How the fast twin takes a step: ``(manager, request, num_new_tokens,
delay_cache_blocks) -> KVCacheBlocks | None`` (raising what the general path raises)."""


def drive_twins(fast: KVCacheManager, general: KVCacheManager, rng: random.Random, *, steps: int,
                vocab: int, max_prompt: int, num_new: Sequence[int], fast_step: FastStep) -> int:
    """Drive the twins ``steps`` times; returns how many steps changed the
    fast twin's state (so a test can insist its fast path did the work)."""
    twins = (fast, general)
    live: dict[str, list[Request]] = {}
    changed = 0
    for step in range(steps):
        if not live or rng.random() < 0.08:
            request_id = f"r{step}"
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, max_prompt))]
            pair = [manager.make_request(request_id, prompt) for manager in twins]
            results = [manager.allocate_slots(r, len(prompt)) for manager, r in zip(twins, pair)]
            assert (results[0] is None) == (results[1] is None), step
            if results[0] is not None:
                for r in pair:
                    r.num_computed_tokens = len(prompt)
                live[request_id] = pair
            continue
        request_id = rng.choice(sorted(live))
        pair = live[request_id]
        if rng.random() < 0.1:
            for manager, r in zip(twins, pair):
                manager.free(r)
            del live[request_id]
            continue
        count = rng.choice(num_new)
        delay = rng.random() < 0.15
        malformed = rng.random() < 0.04
        # Odd steps: fewer tokens than scheduled (min(total, num_tokens) caches).
        appended = [rng.randrange(vocab) for _ in range(rng.randrange(0, count + 1) if step % 2 else count)]
        for r in pair:
            for token in appended:
                r.append_output_token_ids(token)
            if malformed:
                r.num_computed_tokens = -1
        before = fast.snapshot()
        outcomes: list[object] = []
        for manager, r in zip(twins, pair):
            try:
                result = (fast_step(manager, r, count, delay) if manager is fast
                          else manager.allocate_slots(r, count, delay_cache_blocks=delay))
                outcomes.append(None if result is None else result.get_block_ids())
            except Exception as error:  # the same typed error from both
                outcomes.append(type(error))
        assert outcomes[0] == outcomes[1], (step, outcomes)
        assert fast.snapshot() == general.snapshot(), step
        assert fast.take_events() == general.take_events(), step
        changed += fast.snapshot() != before
        if malformed:  # refused by the general path: the request goes
            for manager, r in zip(twins, pair):
                r.num_computed_tokens = 0
                manager.free(r)
            del live[request_id]
        elif isinstance(outcomes[0], tuple):
            for r in pair:
                r.num_computed_tokens += count
        fast.check_invariants()
    return changed
