"""Deterministic workloads for the engine check: token-id prompts, greedy sampling.

Token ids start at 3 so no prompt holds the tokenizer's special ids (0 unk, 1 bos, 2 eos); every
request runs with ignore_eos so its output length is fixed by max_tokens alone.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

BLOCK_SIZE = 32
LOW_ID, HIGH_ID = 3, 1023


@dataclass(frozen=True)
class Batch:
    """One `LLM.generate` call: prompts and per-prompt max_tokens."""

    prompts: list[list[int]]
    max_tokens: list[int]
    # Per prompt, SamplingParams.extra_args (the OpenAI server's vllm_xargs), or None.
    extra_args: list[dict[str, Any] | None] | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    # None: the engine sizes the pool itself from VLLM_CPU_KVCACHE_SPACE.
    num_blocks: int | None
    max_model_len: int
    max_num_seqs: int
    batches: list[Batch] = field(default_factory=list)
    # Workloads whose pool and model match run in the same engine, one after the other.
    expect_hits: bool = True
    expect_preemptions: bool = False
    # pagedkv's retention setting (docs/retention.md), passed to pagedkv's engine as
    # additional_config["pagedkv_retention"]; stock vLLM runs without it.
    retention: dict[str, Any] | None = None
    # (request index, tokens): that request must hit at least this many tokens on pagedkv and
    # fewer on stock; the only difference allowed (extra hits, identical tokens). None: none.
    retained: tuple[int, int] | None = None

    @property
    def engine_key(self) -> tuple[str, int | None, int, int, str]:
        return (self.model, self.num_blocks, self.max_model_len, self.max_num_seqs,
                json.dumps(self.retention, sort_keys=True))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(LOW_ID, HIGH_ID) for _ in range(n)]


def shared_prefix(model: str, seed: int) -> Workload:
    """Prompts over 4 shared system prefixes, run twice: the second pass hits the first's blocks."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, BLOCK_SIZE * rng.randint(3, 6) + rng.randint(0, 20)) for _ in range(4)]
    first = [prefixes[i % 4] + _tokens(rng, rng.randint(5, 120)) for i in range(16)]
    # Pass two: the same prompts again (whole-prompt hits) and new ones on the same prefixes.
    second = list(first[:8]) + [prefixes[i % 4] + _tokens(rng, rng.randint(5, 120)) for i in range(8)]
    return Workload(
        name=f"{model}/shared-prefix x2",
        model=model,
        num_blocks=None,
        max_model_len=1024,
        max_num_seqs=32,
        batches=[
            Batch(first, [rng.randint(8, 24) for _ in first]),
            Batch(second, [rng.randint(8, 24) for _ in second]),
        ],
    )


def evicting_pool(model: str, seed: int) -> Workload:
    """A 40-block pool: later batches evict the cached blocks of earlier ones; re-asks hit or miss."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, BLOCK_SIZE * 4 + 7) for _ in range(8)]
    batches = []
    for wave in range(4):
        prompts = [prefixes[(2 * wave + j) % 8] + _tokens(rng, rng.randint(10, 60)) for j in range(4)]
        batches.append(Batch(prompts, [rng.randint(4, 16) for _ in prompts]))
    # Re-ask every prefix: the oldest were evicted, the newest are still cached.
    prompts = [p + _tokens(rng, 9) for p in prefixes]
    batches.append(Batch(prompts, [8] * len(prompts)))
    return Workload(
        name=f"{model}/evicting pool (40 blocks)",
        model=model,
        num_blocks=40,
        max_model_len=512,
        max_num_seqs=4,
        batches=batches,
    )


def preempting_pool(model: str, seed: int, num_blocks: int = 20, max_model_len: int = 512) -> Workload:
    """A pool of a few blocks and 8 long decodes at once: it runs out and requests are preempted."""
    rng = random.Random(seed)
    shared = _tokens(rng, BLOCK_SIZE * 2)
    prompts = [shared + _tokens(rng, rng.randint(20, 90)) for _ in range(8)]
    return Workload(
        name=f"{model}/preempting pool ({num_blocks} blocks)",
        model=model,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=8,
        batches=[Batch(prompts, [rng.randint(120, 200) for _ in prompts])],
        expect_preemptions=True,
    )


def mixed(model: str, seed: int, count: int = 240) -> Workload:
    """`count` requests of mixed lengths, a third of them on shared prefixes; one generate call."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, BLOCK_SIZE * rng.randint(2, 8)) for _ in range(6)]
    prompts: list[list[int]] = []
    for _ in range(count):
        unique = _tokens(rng, rng.choice([rng.randint(4, 40), rng.randint(40, 200), rng.randint(200, 500)]))
        prompts.append(rng.choice(prefixes) + unique if rng.random() < 0.35 else unique)
    return Workload(
        name=f"{model}/mixed {count} requests",
        model=model,
        num_blocks=None,
        max_model_len=1024,
        max_num_seqs=32,
        batches=[Batch(prompts, [rng.choice([1, 4, 16, 32, 64]) for _ in prompts])],
    )


def pinned_prefix(model: str, seed: int, pin_budget: float) -> Workload:
    """A system prompt pinned by its first request (``vllm_xargs`` pin), then a flood of unique
    long prompts through a 48-block pool that evicts every unpinned block, then the system prompt
    again. With a pin budget the pin holds and the last request hits the whole prefix; with
    budget 0 the pin is refused, and pagedkv (lru) loses the prefix exactly as stock vLLM does."""
    rng = random.Random(seed)
    system = _tokens(rng, BLOCK_SIZE * 4)
    pin = {"pagedkv_retention": {"pin": {"num_tokens": len(system)}}}
    batches = [Batch([system + _tokens(rng, 20)], [8], [pin]),
               Batch([system + _tokens(rng, 25)], [8], [pin])]  # hits the prefix everywhere
    for _ in range(4):  # 8 x 10 blocks through 47 usable blocks: LRU evicts everything older
        prompts = [_tokens(rng, BLOCK_SIZE * 9 + rng.randint(5, 30)) for _ in range(2)]
        batches.append(Batch(prompts, [4, 4]))
    batches.append(Batch([system + _tokens(rng, 17)], [8]))
    return Workload(
        name=f"{model}/pinned prefix vs flood (pin budget {pin_budget})",
        model=model,
        num_blocks=48,
        max_model_len=512,
        max_num_seqs=4,
        batches=batches,
        retention={"policy": "lru", "pin_budget": pin_budget},
        # The last request (requests are numbered over the batches in order).
        retained=(sum(len(b.prompts) for b in batches) - 1, len(system)) if pin_budget else None,
    )


def all_workloads() -> list[Workload]:
    return [
        shared_prefix("llama", 1),
        evicting_pool("llama", 2),
        preempting_pool("llama", 3),
        mixed("llama", 4),
        shared_prefix("hybrid", 5),
        evicting_pool("hybrid", 6),
        # Two groups share the pool; vLLM needs room for one max-length request in each.
        preempting_pool("hybrid", 7, num_blocks=32, max_model_len=384),
        mixed("hybrid", 8, count=80),
        # Retention (docs/retention.md): budget 0 is lru, identical to stock; 0.25 keeps the pin.
        pinned_prefix("llama", 9, 0.0),
        pinned_prefix("llama", 9, 0.25),
    ]
