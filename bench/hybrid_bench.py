"""Hybrid-model benchmarks: the standard chat trace on hybrid KV caches, and
the cost of the hybrid hit search against prompt length.

1. The standard chat trace (``pagedkv.trace``, the anchors' 256 requests) on
   a Gemma-3-like model (5 sliding-window groups of window 1024 : 1
   full-attention group, block size 16) and on a Jamba-like Mamba hybrid
   (full attention + Mamba in mode ``"all"``): per-call µs, optimized and
   reference. The reference replays only the first requests of the trace
   (``REFERENCE_REQUESTS``), so the whole bench stays within about two
   minutes; per-call figures are comparable, totals are not.
2. Hit search vs prompt length (1k-128k tokens) on the Gemma-3-like model:
   a request's prompt is computed and freed, then a request sharing only
   its first half looks its prefix up. The full-attention groups' cached
   prefix ends at half the prompt; the brute force of the reference tries
   every aligned length from the end down to it, the fixed-point search
   scans that prefix once and checks one window per sliding-window group.
   The reference runs only up to ``REFERENCE_MAX_SEARCH_TOKENS``.

Only manager calls are timed (``time.perf_counter_ns``); medians over runs.
Run alone: ``.venv/bin/python -m bench.hybrid_bench [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import Any

from pagedkv.trace import (
    CALL_KINDS,
    DEFAULT_NUM_BLOCKS,
    STANDARD,
    TraceConfig,
    TraceDriver,
    make_manager,
    standard_trace,
)

__all__ = ["run", "run_hybrid_trace", "run_hit_search", "HYBRID_MODELS", "SEARCH_LENGTHS"]

HYBRID_MODELS: tuple[str, ...] = ("gemma3", "jamba")
"""Trace models of :mod:`pagedkv.trace` benchmarked here."""

SEARCH_LENGTHS: tuple[int, ...] = (1024, 4096, 16384, 65536, 131072)
"""Prompt lengths (tokens) of the hit-search benchmark."""

REFERENCE_REQUESTS = 64
"""Requests of the trace the reference replays (one batch)."""

REFERENCE_MAX_SEARCH_TOKENS = 16384
"""Longest prompt the reference's brute-force search is timed on."""


def run_hybrid_trace(implementation: str, model: str, runs: int,
                     num_requests: int = STANDARD.num_requests) -> dict[str, Any]:
    """The standard trace (its first ``num_requests`` requests) on ``model``;
    medians over ``runs`` fresh managers of µs per call and the manager total."""
    config = TraceConfig(num_requests=num_requests)
    steps = list(standard_trace(config))
    per_call: dict[str, list[float]] = {kind: [] for kind in CALL_KINDS}
    totals: list[float] = []
    calls: dict[str, int] = {}
    for _ in range(runs):
        manager = make_manager(implementation, num_blocks=DEFAULT_NUM_BLOCKS[model],
                               block_size=config.block_size, model=model, hash_fn="xxh3_128")
        driver = TraceDriver(manager)
        gc.collect()
        driver.run(steps)
        for kind in CALL_KINDS:
            per_call[kind].append(driver.us_per_call(kind))
        totals.append(driver.manager_total_ns / 1e6)
        calls = dict(driver.calls)
    return {
        "us_per_call": {kind: statistics.median(values) for kind, values in per_call.items()},
        "manager_total_ms": statistics.median(totals),
        "calls": calls,
        "requests": num_requests,
        "runs": runs,
    }


def _search_once(implementation: str, prompt_tokens: int, repeats: int) -> tuple[float, int]:
    """Median µs of ``get_computed_blocks`` for a request sharing the first
    half of a computed, freed prompt of ``prompt_tokens`` tokens; and its hit."""
    block_size = 16
    num_blocks = 6 * (prompt_tokens // block_size + 2) + 64
    manager: Any = make_manager(implementation, num_blocks=num_blocks, block_size=block_size,
                                max_model_len=prompt_tokens + block_size, model="gemma3",
                                hash_fn="xxh3_128")
    rng = random.Random(prompt_tokens)
    prompt = [rng.randrange(32000) for _ in range(prompt_tokens)]
    first = manager.make_request("first", prompt)
    assert manager.allocate_slots(first, prompt_tokens) is not None
    manager.free(first)
    half = prompt_tokens // 2
    probe = manager.make_request("probe", prompt[:half] + [rng.randrange(32000) for _ in range(half)])
    times: list[int] = []
    hit = 0
    for _ in range(repeats):
        start = time.perf_counter_ns()
        _, hit = manager.get_computed_blocks(probe)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000, hit


def run_hit_search(quick: bool = False) -> list[dict[str, Any]]:
    """Hit-search cost per prompt length, optimized and (up to
    :data:`REFERENCE_MAX_SEARCH_TOKENS`) reference."""
    rows: list[dict[str, Any]] = []
    for length in SEARCH_LENGTHS:
        optimized_us, hit = _search_once("optimized", length, 5 if quick else 21)
        row: dict[str, Any] = {"prompt_tokens": length, "hit_tokens": hit, "optimized_us": optimized_us,
                               "reference_us": None}
        if length <= REFERENCE_MAX_SEARCH_TOKENS:
            reference_us, reference_hit = _search_once("reference", length, 1 if quick else 3)
            assert reference_hit == hit, (length, hit, reference_hit)
            row["reference_us"] = reference_us
        rows.append(row)
    return rows


def _print_tables(result: dict[str, Any]) -> None:
    for model in HYBRID_MODELS:
        optimized, reference = result["trace"][model]["optimized"], result["trace"][model]["reference"]
        print(f"\n## Standard chat trace on {model} (xxh3_128; reference: first "
              f"{reference['requests']} requests)")
        print("| call (µs/call) | optimized | reference | ref/opt |")
        print("|---|---|---|---|")
        for kind in ("get_computed_blocks", "allocate_slots", "free", "make_request"):
            fast, slow = optimized["us_per_call"][kind], reference["us_per_call"][kind]
            ratio = f"{slow / fast:.1f}" if fast else "–"
            print(f"| {kind} | {fast:.2f} | {slow:.2f} | {ratio} |")
        print(f"| manager total (ms, all {optimized['requests']} requests) | "
              f"{optimized['manager_total_ms']:.1f} | – | – |")
    print("\n## Hybrid hit search vs prompt length (gemma3, half the prompt cached; µs per lookup)")
    print("| prompt tokens | hit tokens | optimized | reference |")
    print("|---|---|---|---|")
    for row in result["hit_search"]:
        reference_us = "–" if row["reference_us"] is None else f"{row['reference_us']:.0f}"
        print(f"| {row['prompt_tokens']} | {row['hit_tokens']} | {row['optimized_us']:.1f} | {reference_us} |")


def run(quick: bool = False) -> dict[str, object]:
    """Every hybrid figure (see the module docstring); prints Markdown
    tables, returns the figures as a JSON-ready dict."""
    runs = 2 if quick else 5
    trace: dict[str, Any] = {}
    for model in HYBRID_MODELS:
        trace[model] = {
            "optimized": run_hybrid_trace("optimized", model, runs),
            "reference": run_hybrid_trace("reference", model, 1, REFERENCE_REQUESTS),
        }
    result: dict[str, object] = {"trace": trace, "hit_search": run_hit_search(quick)}
    _print_tables(result)
    return result


def main() -> None:
    """``python -m bench.hybrid_bench [--quick] [--json PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer runs and repetitions")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    started = time.perf_counter()
    result = run(args.quick)
    print(f"\n(hybrid bench took {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
