"""Workloads that both sides of ``bench.vllm_side_by_side`` replay, and the
one-request-at-a-time driver that times them.

This module imports only the standard library: vLLM's interpreter loads it
by path (``importlib``), so pagedkv and vLLM replay the very same token
lists through the very same timed loop. A *side* is four callables:

- ``make(request_id, prompt) -> request`` (creation, prompt hashing included),
- ``lookup(request) -> (blocks, hit_tokens, ...)``,
- ``allocate(request, num_new_tokens, hit_tokens, blocks) -> result or None``,
- ``free(request)``.

Each request goes through make, lookup, allocate (every token the hit did not
cover, in one call) and free before the next one starts, so only prompt
allocation is measured (no decode, no batching). ``perf_counter_ns`` brackets
each call alone.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

__all__ = ["VOCAB", "MOONCAKE_ID_TOKENS", "long_prompts", "mooncake_requests", "mooncake_prompts",
           "replay_one_at_a_time", "summarize"]

VOCAB = 32000
MOONCAKE_ID_TOKENS = 512
"""Tokens one Mooncake hash id stands for."""

_TABLE_BITS = 20
_table: list[int] | None = None


def _token_table() -> list[int]:
    """2**20 + 512 pseudo-random token ids (seed 17), made once. A hash id's
    512 tokens are one slice of it (C speed, no per-token Python work)."""
    global _table
    if _table is None:
        rng = random.Random(17)
        _table = [rng.randrange(VOCAB) for _ in range((1 << _TABLE_BITS) + MOONCAKE_ID_TOKENS)]
    return _table


def hash_id_tokens(hash_id: int) -> list[int]:
    """The 512 deterministic token ids hash id ``hash_id`` stands for. The
    slice offset ``hash_id * 40503 mod 2**20`` is a bijection on ids below
    2**20 (40503 is odd), so distinct ids get distinct token runs."""
    offset = (hash_id * 40503) & ((1 << _TABLE_BITS) - 1)
    return _token_table()[offset:offset + MOONCAKE_ID_TOKENS]


def mooncake_requests(path: str, limit: int | None = None) -> list[tuple[int, list[int]]]:
    """``(input_length, hash_ids)`` of the first ``limit`` requests (all when None)."""
    out: list[tuple[int, list[int]]] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if limit is not None and len(out) >= limit:
                break
            record = json.loads(line)
            out.append((int(record["input_length"]), [int(h) for h in record["hash_ids"]]))
    return out


def mooncake_prompts(requests: Sequence[tuple[int, list[int]]]) -> Iterator[list[int]]:
    """Each request's prompt: its hash ids' tokens, cut to ``input_length``
    (made lazily: the whole trace holds 145 M tokens)."""
    for input_length, hash_ids in requests:
        prompt: list[int] = []
        for hash_id in hash_ids:
            prompt += hash_id_tokens(hash_id)
        del prompt[input_length:]
        yield prompt


def long_prompts(prompt_tokens: int, repeats: int, seed: int = 5) -> list[list[int]]:
    """``repeats + 1`` prompts of ``prompt_tokens`` tokens: one shared first
    half, a unique second half each. The first prompt only warms the cache
    (its shared half is computed); the others hit that half."""
    rng = random.Random(seed * 1_000_003 + prompt_tokens)
    half = prompt_tokens // 2
    shared = [rng.randrange(VOCAB) for _ in range(half)]
    return [shared + [rng.randrange(VOCAB) for _ in range(prompt_tokens - half)]
            for _ in range(repeats + 1)]


def replay_one_at_a_time(
    prompts: Iterable[list[int]],
    block_size: int,
    make: Callable[[str, list[int]], Any],
    lookup: Callable[[Any], Sequence[Any]],
    allocate: Callable[[Any, int, int, Any], Any],
    free: Callable[[Any], None],
    skip_first: int = 0,
) -> dict[str, Any]:
    """Make, look up, allocate and free each prompt in turn; nanoseconds per
    call kind summed over the requests after the first ``skip_first`` (which
    run untimed-in-the-totals, to warm the cache), the hit tokens of every
    request, and the block counts the per-block figures divide by.

    Raises:
        RuntimeError: an allocation was refused (the pool is too small).
    """
    clock = time.perf_counter_ns
    ns = {"make_request": 0, "get_computed_blocks": 0, "allocate_slots": 0, "free": 0}
    hits: list[int] = []
    tokens = hit_blocks = new_blocks = held_blocks = 0
    for index, prompt in enumerate(prompts):
        request_id = f"r{index}"
        t0 = clock()
        request = make(request_id, prompt)
        t1 = clock()
        looked_up = lookup(request)
        t2 = clock()
        blocks, hit = looked_up[0], looked_up[1]  # vLLM answers a 3-tuple: unpacked untimed
        result = allocate(request, len(prompt) - hit, hit, blocks)
        t3 = clock()
        if result is None:
            raise RuntimeError(f"allocation of request {index} ({len(prompt)} tokens) was refused")
        free(request)
        t4 = clock()
        hits.append(hit)
        if index < skip_first:
            continue
        ns["make_request"] += t1 - t0
        ns["get_computed_blocks"] += t2 - t1
        ns["allocate_slots"] += t3 - t2
        ns["free"] += t4 - t3
        held = -(-len(prompt) // block_size)
        tokens += len(prompt)
        hit_blocks += hit // block_size
        new_blocks += held - hit // block_size
        held_blocks += held
    return {"ns": ns, "hits": hits, "tokens": tokens, "hit_blocks": hit_blocks,
            "new_blocks": new_blocks, "held_blocks": held_blocks}


def summarize(raw: dict[str, Any]) -> dict[str, float]:
    """Per-unit figures of one replay: ns per token of creation, ns per hit
    block of lookup (per call when nothing hit), ns per new block of
    allocation, ns per held block of free, and the manager total in ms."""
    ns = raw["ns"]
    manager = ns["get_computed_blocks"] + ns["allocate_slots"] + ns["free"]
    return {
        "make_request": ns["make_request"] / max(1, raw["tokens"]),
        "get_computed_blocks": ns["get_computed_blocks"] / max(1, raw["hit_blocks"]),
        "allocate_slots": ns["allocate_slots"] / max(1, raw["new_blocks"]),
        "free": ns["free"] / max(1, raw["held_blocks"]),
        "manager_ms": manager / 1e6,
        "manager_and_creation_ms": (manager + ns["make_request"]) / 1e6,
    }
