"""The retention simulator's model: a block-level prefix cache replayed over
Mooncake-style traces, one request at a time, with a pluggable eviction policy
(:mod:`pagedkv.simulate.retention_policies`). Used by ``pagedkv simulate
--policy`` (:mod:`pagedkv.simulate.retention_cli`) and by the study that chose
the online policy (``bench/retention_study.py``).

The model: a request's prompt is its chain of block ids (``hash_ids``; 512
tokens a block); only full blocks are cached, and at least the prompt's last
token is computed, so a hit covers at most ``(input_length - 1) // 512``
blocks; its hit is the longest resident prefix of its chain; its blocks stay
held while it runs; the missing ones are admitted (the policy evicts one victim
per admission once the cache is full); then it releases its blocks tail first
and they stay cached, evictable. Belady's MIN (``min``) is the offline optimum
of this model. Capacity is a fraction of a workload's *working set* (its
distinct full blocks).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedkv.simulate.retention_candidates import GroupFreq, ReuseDistance, ScaledAge, SizeAware
from pagedkv.simulate.retention_policies import (
    Arc,
    ChainShape,
    KeyedPolicy,
    Policy,
    S3Fifo,
    VllmLru,
    key_gdsf,
    key_lfu,
    key_lru,
    key_lru2,
    key_lru_freq,
    key_min,
    key_reuse_oracle,
    lru_freq_key,
)

__all__ = ["BLOCK_TOKENS", "Request", "Workload", "Result", "load_trace", "system_prompt_workload",
           "simulate", "POLICIES", "ONLINE", "UNANNOTATED", "run", "table", "PolicyFactory"]

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: its length in tokens and the ids of its full blocks."""

    tokens: int
    blocks: tuple[int, ...]
    prefixed: bool = True  # carries the workload's shared prefix (system-prompt workload)


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests in arrival order; ``prefix`` is the shared system prompt's
    blocks (empty for a plain trace); ``working_set`` sizes the capacities."""

    name: str
    requests: tuple[Request, ...]
    prefix: tuple[int, ...] = ()
    working_set: int = 0


def load_trace(path: str, limit: int | None = None) -> Workload:
    """The first ``limit`` requests (all when None) of a Mooncake JSONL trace."""
    requests: list[Request] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if limit is not None and len(requests) >= limit:
                break
            record = json.loads(line)
            tokens = int(record["input_length"])
            requests.append(Request(tokens, tuple(int(h) for h in record["hash_ids"])
                                    [:tokens // BLOCK_TOKENS]))
    name = Path(path).stem + (f"[:{limit}]" if limit is not None else "")
    return Workload(name, tuple(requests), working_set=_distinct(requests))


def _distinct(requests: Sequence[Request]) -> int:
    return len({block for request in requests for block in request.blocks})


def system_prompt_workload(base: Workload, prefix_blocks: int = 8, burst_every: int = 50,
                           burst_share: float = 0.3, doc_blocks: int = 64) -> Workload:
    """``base`` with a shared ``prefix_blocks``-block system prompt (8 = 4k
    tokens) on every request, plus, every ``burst_every`` requests, a burst of
    unique documents (``doc_blocks`` blocks each, no system prompt, never
    reused) totalling ``burst_share`` of the chat part's working set: each
    burst is larger than the cache at fractions below ``burst_share``, so it
    flushes the system prompt under LRU. The working set (what capacities are
    fractions of) is the chat part's: the documents stream through on top.

    Base ids are shifted past the prefix ids (every base chain now hangs below
    the prefix, so the shift keeps "one id, one prefix")."""
    prefix = tuple(range(prefix_blocks))
    shift = prefix_blocks
    top = max((b for r in base.requests for b in r.blocks), default=0) + shift + 1
    chat_set = base.working_set + prefix_blocks
    docs_per_burst = max(1, round(burst_share * chat_set / doc_blocks))
    requests: list[Request] = []
    for index, request in enumerate(base.requests):
        if index and index % burst_every == 0:
            for _ in range(docs_per_burst):
                requests.append(Request(doc_blocks * BLOCK_TOKENS + 1,
                                        tuple(range(top, top + doc_blocks)), prefixed=False))
                top += doc_blocks
        requests.append(Request(request.tokens + prefix_blocks * BLOCK_TOKENS,
                                prefix + tuple(b + shift for b in request.blocks)))
    return Workload(f"system-prompt({base.name})", tuple(requests), prefix, chat_set)


@dataclass(frozen=True, slots=True)
class Result:
    """One policy's run on one workload at one capacity."""

    workload: str
    policy: str
    capacity: int
    hit_blocks: int
    blocks: int
    prompt_tokens: int
    evictions: int
    orphaned: int
    prefix_hits: int  # prefixed requests (after the first) whose whole shared prefix hit
    prefixed: int
    seconds: float

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def tokens_saved(self) -> int:
        return self.hit_blocks * BLOCK_TOKENS

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate(workload: Workload, policy: Policy) -> Result:
    """Replay ``workload`` through ``policy`` (see the module docstring)."""
    started = time.perf_counter()
    resident, capacity = policy.resident, policy.capacity
    hit_blocks = blocks_total = prompt_tokens = prefix_hits = prefixed = 0
    prefix = workload.prefix
    pins: frozenset[int] = getattr(policy, "pins", frozenset())
    for index, request in enumerate(workload.requests):
        policy.now = index
        chain = request.blocks
        limit = min(len(chain), (request.tokens - 1) // BLOCK_TOKENS)
        hit = 0
        while hit < limit and chain[hit] in resident:
            hit += 1
        hit_blocks += hit
        blocks_total += len(chain)
        prompt_tokens += request.tokens
        if prefix and request.prefixed:
            if prefixed and hit >= len(prefix):
                prefix_hits += 1
            prefixed += 1
        held: list[int] = []
        for block in chain:
            if block in resident:
                policy.hit(block)
                held.append(block)
        # Pinned-for-good blocks resident and not held here take room too.
        kept = sum(1 for block in pins if block in resident and block not in policy.pinned) if pins else 0
        for block in chain:
            if block not in resident:
                if len(policy.pinned) + kept >= capacity:
                    break  # the prompt outgrows the cache: the rest is not kept
                policy.admit(block)
                held.append(block)
        order = {block: depth for depth, block in enumerate(chain)}
        policy.release(sorted(held, key=order.__getitem__, reverse=True))
    return Result(workload.name, policy.name, capacity, hit_blocks, blocks_total, prompt_tokens,
                  policy.evictions, policy.orphaned, prefix_hits, max(prefixed - 1, 0),
                  time.perf_counter() - started)


PolicyFactory = Callable[[int, ChainShape, Workload], Policy]


def _keyed(name: str, key: Callable[[KeyedPolicy, int], float], leaf_only: bool,
           annotate: str = "") -> PolicyFactory:
    def make(capacity: int, shape: ChainShape, workload: Workload) -> Policy:
        pins = frozenset(workload.prefix) if annotate == "pin" else frozenset()
        priority = {b: 90 for b in workload.prefix} if annotate == "prio90" else None
        return KeyedPolicy(capacity, shape, name, key, leaf_only=leaf_only, priority=priority,
                           pins=pins)
    return make


POLICIES: dict[str, PolicyFactory] = {
    "lru": lambda capacity, shape, _: VllmLru(capacity, shape),
    "lru2": _keyed("lru2", key_lru2, False),
    "lru2-leaf": _keyed("lru2-leaf", key_lru2, True),
    "lfu-da": _keyed("lfu-da", key_lfu, False),
    "lfu-da-leaf": _keyed("lfu-da-leaf", key_lfu, True),
    "gdsf-leaf": _keyed("gdsf-leaf", key_gdsf, True),
    # Any candidate: lru-freq runs in the pools, so it picks among all free blocks (no leaf rule;
    # its keys never rank a parent before its child, so it orphans nothing anyway).
    "lru-freq": _keyed("lru-freq", key_lru_freq, False),
    # Its sensitivity to the extension (0.75 x capacity per level above) and to the levels.
    "lru-freq-0.5": _keyed("lru-freq-0.5", lru_freq_key(0.5), False),
    "lru-freq-1.0": _keyed("lru-freq-1.0", lru_freq_key(1.0), False),
    "lru-freq-1.5": _keyed("lru-freq-1.5", lru_freq_key(1.5), False),
    "lru-freq-2lv-1.5": _keyed("lru-freq-2lv-1.5", lru_freq_key(1.5, 2), False),
    # Candidates not chosen (pagedkv.simulate.retention_candidates, D-RET-9).
    "scaled-age-2": lambda capacity, shape, _: ScaledAge(capacity, shape, 2.0),
    "scaled-age-3": lambda capacity, shape, _: ScaledAge(capacity, shape, 3.0),
    "lru-freq+short-turn": lambda capacity, shape, _: GroupFreq(capacity, shape, 4),
    "reuse-distance": lambda capacity, shape, _: ReuseDistance(capacity, shape, 1.0, 1.0, 0.0),
    "reuse-distance+freq": lambda capacity, shape, _: ReuseDistance(capacity, shape, 0.5, 0.5, 0.5),
    "size-aware": lambda capacity, shape, _: SizeAware(capacity, shape, 0.2),
    "s3fifo": lambda capacity, shape, _: S3Fifo(capacity, shape),
    "arc": lambda capacity, shape, _: Arc(capacity, shape),
    "min": _keyed("min", key_min, True),
    "oracle-reuse": _keyed("oracle-reuse", key_reuse_oracle, True),  # offline diagnostic
    # Annotated (system-prompt workload only): the shared prefix pinned, or at priority 90.
    "lru+pin": _keyed("lru+pin", key_lru, False, "pin"),
    "lru+prio90": _keyed("lru+prio90", key_lru, False, "prio90"),
}
# The online policies run by default (the -leaf variants of LRU-2 and LFU-DA pick the same
# victims: their keys never rank a parent before its child, see the report).
ONLINE = ["lru2", "lfu-da", "gdsf-leaf", "s3fifo", "arc", "lru-freq"]
UNANNOTATED = ["lru", *ONLINE, "lru2-leaf", "lfu-da-leaf"]


def run(workload: Workload, fractions: Sequence[float], names: Sequence[str]) -> list[Result]:
    """Every policy in ``names`` at every capacity fraction of ``workload``."""
    shape = ChainShape([r.blocks for r in workload.requests])
    results = []
    for fraction in fractions:
        capacity = max(1, round(fraction * workload.working_set))
        for name in names:
            result = simulate(workload, POLICIES[name](capacity, shape, workload))
            print(f"{workload.name} x{fraction} {name}: {result.block_hit_rate:.4f} "
                  f"({result.seconds:.1f} s)", file=sys.stderr)
            results.append(result)
    return results


def table(results: Sequence[Result], fractions: Sequence[float]) -> str:
    """Markdown: per capacity, each policy's hit rates, tokens saved, gap closed."""
    lines: list[str] = []
    capacities = sorted({r.capacity for r in results})
    with_prefix = any(r.prefixed for r in results)
    for capacity, fraction in zip(capacities, sorted(fractions)):
        group = [r for r in results if r.capacity == capacity]
        by_name = {r.policy: r for r in group}
        lru, best = by_name.get("lru"), by_name.get("min")
        gap = best.hit_blocks - lru.hit_blocks if lru and best else 0
        lines += [f"\n**{fraction}x working set = {capacity:,} blocks "
                  f"({capacity * BLOCK_TOKENS / 1e6:.1f} M tokens)**\n",
                  "| policy | block hit rate | token hit rate | prefill tokens saved (M) "
                  "| LRU->MIN gap closed | orphaning evictions |"
                  + (" prefix hit on requests |" if with_prefix else ""),
                  "|---|---|---|---|---|---|" + ("---|" if with_prefix else "")]
        for r in group:
            closed = f"{(r.hit_blocks - lru.hit_blocks) / gap:+.1%}" if lru and gap else "-"
            row = (f"| {r.policy} | {r.block_hit_rate:.4f} | {r.token_hit_rate:.4f} | "
                   f"{r.tokens_saved / 1e6:.2f} | {closed} | {r.orphaned:,} |")
            if with_prefix:
                row += f" {r.prefix_hits / r.prefixed:.2%} |" if r.prefixed else " - |"
            lines.append(row)
    return "\n".join(lines)
