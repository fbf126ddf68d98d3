"""Comparison of two engine runs of the same workload: tokens, cached tokens, counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Verdict:
    workload: str
    requests: int
    differing_tokens: int
    differing_cached: int
    counters_a: dict[str, float]
    counters_b: dict[str, float]
    cached_tokens: int
    preemptions: int
    # Requests where the candidate hit fewer tokens than stock (a known difference allows more only).
    fewer_cached: int = 0

    @property
    def identical(self) -> bool:
        return (
            self.differing_tokens == 0
            and self.differing_cached == 0
            and self.counters_a == self.counters_b
        )

    def describe(self) -> str:
        if self.identical:
            return "identical"
        parts = []
        if self.differing_tokens:
            parts.append(f"{self.differing_tokens}/{self.requests} outputs differ")
        if self.differing_cached:
            parts.append(f"{self.differing_cached}/{self.requests} cached counts differ")
        if self.counters_a != self.counters_b:
            parts.append(f"counters {self.counters_a} vs {self.counters_b}")
        return "DIFFERENT: " + "; ".join(parts)


def compare(a: dict[str, Any], b: dict[str, Any]) -> Verdict:
    """`a`, `b`: one workload's results from worker.run_workload (a is the stock engine)."""
    if a["workload"] != b["workload"]:
        raise ValueError(f"workload mismatch: {a['workload']!r} vs {b['workload']!r}")
    oa, ob = a["outputs"], b["outputs"]
    if len(oa) != len(ob):
        raise ValueError(f"{a['workload']}: {len(oa)} vs {len(ob)} outputs")
    return Verdict(
        workload=a["workload"],
        requests=len(oa),
        differing_tokens=sum(x["tokens"] != y["tokens"] for x, y in zip(oa, ob)),
        differing_cached=sum(x["cached"] != y["cached"] for x, y in zip(oa, ob)),
        counters_a=a["counters"],
        counters_b=b["counters"],
        cached_tokens=sum(x["cached"] for x in oa),
        preemptions=int(a["counters"].get("vllm:num_preemptions", 0)),
        fewer_cached=sum(y["cached"] < x["cached"] for x, y in zip(oa, ob)),
    )


def within_known_difference(v: Verdict) -> bool:
    """True if the candidate differs only by extra prefix-cache hits and what follows from them
    (when a preemption falls): the same tokens for every request, the same number of queries,
    no request that hit fewer tokens than on stock, and no fewer hits in all."""
    queries = "vllm:prefix_cache_queries"
    hits = "vllm:prefix_cache_hits"
    return (v.differing_tokens == 0 and v.fewer_cached == 0
            and v.counters_a.get(queries) == v.counters_b.get(queries)
            and v.counters_b.get(hits, 0) >= v.counters_a.get(hits, 0))


def without_stores_of(batches: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The stream less the ``BlockStored`` events of groups of ``kind`` (batches left empty go,
    sequence numbers are dropped): what stays comparable where a known difference is confined
    to those groups."""
    kept = []
    for batch in batches:
        events = [e for e in batch["events"]
                  if not (e["type"] == "BlockStored" and e.get("kv_cache_spec_kind") == kind)]
        if events:
            kept.append({"seq": None, "events": events, "rank": batch["rank"]})
    return kept


def compare_events(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[bool, str]:
    """Two recorded KV event streams (worker.event_batches; `a` is stock's): identical batch for
    batch, event for event (sequence numbers, types, every field), timestamps aside."""
    events = sum(len(batch["events"]) for batch in a)
    kinds: dict[str, int] = {}
    for batch in a:
        for event in batch["events"]:
            kinds[event["type"]] = kinds.get(event["type"], 0) + 1
    summary = f"{len(a)} batches, {events} events ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})"
    if a == b:
        return True, f"event stream identical: {summary}"
    if len(a) != len(b):
        where = f"{len(a)} vs {len(b)} batches"
    else:
        index = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        x, y = a[index], b[index]
        where = f"batch {index} (seq {x['seq']} vs {y['seq']}): {len(x['events'])} vs {len(y['events'])} events"
        pair = next(((e, f) for e, f in zip(x["events"], y["events"]) if e != f), None)
        if pair is not None:
            keys = sorted(k for k in set(pair[0]) | set(pair[1]) if pair[0].get(k) != pair[1].get(k))
            where += f"; first differing {pair[0].get('type')} differs in {', '.join(keys)}"
    return False, f"event stream DIFFERENT: {where} (stock: {summary})"
