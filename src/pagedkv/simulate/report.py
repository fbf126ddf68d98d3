"""Results of a simulation as plain data, a table, JSON and CSV.

:func:`run_summary` turns one replay (:class:`FleetResult`) into a flat
dict of figures; :func:`report` gathers the workload, its analysis and the
runs into the JSON document ``--json`` prints; :func:`print_table` and
:func:`write_csv` print the same runs for people and spreadsheets.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from typing import Any, TextIO

from pagedkv.simulate.analysis import WorkloadAnalysis
from pagedkv.simulate.capacity import Capacity
from pagedkv.simulate.fleet import FleetResult
from pagedkv.simulate.workload import Workload

__all__ = ["run_summary", "report", "capacity_for_share", "print_table", "write_csv", "CSV_FIELDS"]


def _percentile(values: Sequence[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def run_summary(result: FleetResult, capacity: Capacity, analysis: WorkloadAnalysis) -> dict[str, Any]:
    """The figures of one replay (hit rates over the workload's prompts:
    rejected requests count as misses)."""
    stats = result.replicas
    hit_tokens = sum(s.hit_tokens for s in stats)
    hit_blocks = sum(s.hit_blocks for s in stats)
    prompt_tokens = analysis.prompt_tokens
    routed_tokens = [s.prompt_tokens for s in stats]
    mean_tokens = sum(routed_tokens) / len(routed_tokens) if routed_tokens else 0.0
    delays = [d for s in stats for d in s.queue_delay_ms]
    ttft = [d for s in stats for d in s.ttft_ms]
    busy = [s.busy_ms for s in stats]
    hit_rate = hit_tokens / prompt_tokens if prompt_tokens else 0.0
    return {
        "capacity": capacity.label,
        "num_blocks": capacity.num_blocks,
        "capacity_tokens": capacity.tokens(result.block_size),
        "mode": result.mode,
        "replicas": len(stats),
        "router": result.router,
        "hit_rate": hit_rate,
        "block_hit_rate": hit_blocks / analysis.prompt_blocks if analysis.prompt_blocks else 0.0,
        "share_of_ideal": hit_rate / analysis.ideal_hit_rate if analysis.ideal_hit_rate else 0.0,
        "hit_tokens": hit_tokens,
        "prefill_tokens_saved": hit_tokens,
        "prefill_tokens_computed": sum(s.prefill_tokens_computed for s in stats),
        "requests_served": sum(s.finished for s in stats),
        "requests_rejected": sum(s.rejected for s in stats),
        "preemptions": sum(s.preemptions for s in stats),
        "evicted_blocks": sum(s.evicted_blocks for s in stats),
        "stored_blocks": sum(s.stored_blocks for s in stats),
        "queue_delay_ms_p50": _percentile(delays, 0.5),
        "queue_delay_ms_p99": _percentile(delays, 0.99),
        "queue_delay_ms_mean": sum(delays) / len(delays) if delays else None,
        "ttft_ms_p50": _percentile(ttft, 0.5),
        "ttft_ms_p99": _percentile(ttft, 0.99),
        "simulated_span_s": result.span_ms / 1000.0,
        "utilization_max": (max(busy) / result.span_ms) if result.span_ms and busy else None,
        "requests_per_replica": list(result.routed),
        "prompt_tokens_per_replica": routed_tokens,
        "load_imbalance": (max(routed_tokens) / mean_tokens) if mean_tokens else None,
        "replica_hit_rates": [s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0 for s in stats],
        "wall_s": result.wall_s,
        "route_us_per_request": (result.route_s / result.decisions * 1e6) if result.decisions else None,
        "blocks_hashed": result.hashed_blocks,
        "blocks_hash_memoised": result.memoised_blocks,
        "timeline": [list(point) for point in stats[0].timeline] if stats else [],
    }


def capacity_for_share(runs: Sequence[dict[str, Any]],
                       target: float) -> tuple[str | None, float | None, bool]:
    """The smallest capacity of a sweep whose hit rate reaches ``target``;
    the tokens it takes, log-linearly interpolated from the capacity below
    when there is one; whether it was interpolated. (None, None, False) when
    no run reaches it. Only single-replica runs are read."""
    points = sorted((r["capacity_tokens"], r["hit_rate"], r["capacity"]) for r in runs if r["replicas"] == 1)
    previous: tuple[int, float, str] | None = None
    for tokens, rate, label in points:
        if rate >= target - 1e-12:
            if previous is None or previous[1] >= rate or previous[0] <= 0:
                return label, float(tokens), False
            low_tokens, low_rate, _ = previous
            fraction = (target - low_rate) / (rate - low_rate)
            estimate = math.exp(math.log(low_tokens) + fraction * (math.log(tokens) - math.log(low_tokens)))
            return label, estimate, True
        previous = (tokens, rate, label)
    return None, None, False


def report(workload: Workload, analysis: WorkloadAnalysis, runs: list[dict[str, Any]],
           settings: dict[str, Any]) -> dict[str, Any]:
    """The whole result as one JSON-ready dict."""
    reuse = analysis.reuse_distances
    h = analysis.hash_block_size
    label, estimate, interpolated = capacity_for_share(runs, 0.9 * analysis.ideal_hit_rate)
    grid = [10 ** (k / 4) for k in range(12, 38)]  # 1e3 .. 1e9 tokens
    return {
        "workload": {
            "name": workload.name, "requests": analysis.requests, "trace_block_tokens": workload.block_tokens,
            "prompt_tokens": analysis.prompt_tokens, "output_tokens": workload.output_tokens,
            "span_s": ((workload.requests[-1].arrival_ms - workload.requests[0].arrival_ms) / 1000.0
                       if workload.requests else 0.0),
            "sessions": len({r.session for r in workload.requests if r.session is not None}) or None,
        },
        "settings": settings,
        "ideal": {
            "block_size": h,
            "hit_rate": analysis.ideal_hit_rate,
            "block_hit_rate": analysis.ideal_block_hit_rate,
            "working_set_tokens": analysis.working_set_tokens,
            "distinct_blocks": analysis.distinct_blocks,
            "capacity_for_90pct_of_ideal": {"smallest_run": label, "tokens": estimate,
                                             "interpolated": interpolated},
            "lru_model_tokens_for_90pct_of_reuse": analysis.lru_capacity_for(0.9),
        },
        "reuse_distance_tokens": {
            "accesses": len(reuse),
            "p50": reuse[len(reuse) // 2] * h if reuse else None,
            "p90": reuse[int(len(reuse) * 0.9)] * h if reuse else None,
            "p99": reuse[int(len(reuse) * 0.99)] * h if reuse else None,
            "cdf": [[tokens, share] for tokens, share in zip(grid, analysis.reuse_cdf(grid))],
        },
        "runs": runs,
    }


def _fmt(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value)


def _tokens(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


def print_table(doc: dict[str, Any], out: TextIO) -> None:
    """The report for people: the workload, the ideal, one line per run."""
    work, ideal, reuse = doc["workload"], doc["ideal"], doc["reuse_distance_tokens"]
    settings = doc["settings"]
    print(f"pagedkv simulate: {work['name']}, {work['requests']:,} requests, "
          f"{work['prompt_tokens']:,} prompt tokens, {work['output_tokens']:,} output tokens, "
          f"span {work['span_s']:.0f} s" + (f", {work['sessions']:,} sessions" if work["sessions"] else ""),
          file=out)
    print(f"  mode {settings['mode']}, block size {ideal['block_size']}, hash {settings['hash_fn']}, "
          f"seed {settings['seed']}", file=out)
    print(f"  ideal (unbounded cache, one at a time): hit rate {ideal['hit_rate']:.4f} of prompt tokens, "
          f"{ideal['block_hit_rate']:.4f} of blocks; working set {_tokens(ideal['working_set_tokens'])} "
          f"tokens ({ideal['distinct_blocks']:,} blocks)", file=out)
    need = ideal["capacity_for_90pct_of_ideal"]
    if need["smallest_run"] is not None:
        how = ("log-interpolated from the capacity below" if need["interpolated"]
               else "the smallest capacity run")
        print(f"  90% of ideal: first reached at capacity {need['smallest_run']} "
              f"(~{_tokens(need['tokens'])} tokens, {how})", file=out)
    elif any(r["replicas"] == 1 for r in doc["runs"]):
        print("  90% of ideal: not reached by any capacity run", file=out)
    if reuse["accesses"]:
        print(f"  reuse distance (LRU stack distance of reusable blocks): p50 {_tokens(reuse['p50'])}, "
              f"p90 {_tokens(reuse['p90'])}, p99 {_tokens(reuse['p99'])} tokens; an LRU cache keeps 90% "
              f"of reuses from {_tokens(ideal['lru_model_tokens_for_90pct_of_reuse'])} tokens", file=out)
    header = (f"  {'capacity':>9} {'blocks':>9} {'tokens':>7} {'repl':>4} {'router':>12} {'hit':>6} "
              f"{'blk hit':>7} {'%ideal':>6} {'saved':>7} {'evicted':>8} {'rej':>4} {'preempt':>7} "
              f"{'qd p50':>8} {'qd p99':>8} {'ttft p99':>9} {'imbal':>5} {'route us':>8} {'wall s':>6}")
    print(header, file=out)
    for run in doc["runs"]:
        print(f"  {run['capacity']:>9} {run['num_blocks']:>9,} {_tokens(run['capacity_tokens']):>7} "
              f"{run['replicas']:>4} {run['router']:>12} {run['hit_rate']:>6.4f} {run['block_hit_rate']:>7.4f} "
              f"{run['share_of_ideal']:>6.1%} {_tokens(run['prefill_tokens_saved']):>7} "
              f"{run['evicted_blocks']:>8,} {run['requests_rejected']:>4} {run['preemptions']:>7} "
              f"{_fmt(run['queue_delay_ms_p50'], '.0f'):>8} {_fmt(run['queue_delay_ms_p99'], '.0f'):>8} "
              f"{_fmt(run['ttft_ms_p99'], '.0f'):>9} {_fmt(run['load_imbalance'], '.2f'):>5} "
              f"{_fmt(run['route_us_per_request'], '.1f'):>8} {run['wall_s']:>6.1f}", file=out)
    if settings["mode"] == "engine":
        print("  (qd: queueing delay, ttft: time to first token, in simulated ms; imbal: the busiest "
              "replica's prompt tokens over the mean; route us: the router's wall time per decision)", file=out)


CSV_FIELDS: tuple[str, ...] = (
    "capacity", "num_blocks", "capacity_tokens", "mode", "replicas", "router", "hit_rate",
    "block_hit_rate", "share_of_ideal", "prefill_tokens_saved", "prefill_tokens_computed",
    "requests_served", "requests_rejected", "preemptions", "evicted_blocks", "queue_delay_ms_p50",
    "queue_delay_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "load_imbalance", "wall_s", "route_us_per_request",
)


def write_csv(doc: dict[str, Any], handle: TextIO) -> None:
    """One row per run, the columns of :data:`CSV_FIELDS` plus the ideal hit rate."""
    writer = csv.writer(handle)
    writer.writerow((*CSV_FIELDS, "ideal_hit_rate"))
    for run in doc["runs"]:
        writer.writerow((*("" if run[f] is None else run[f] for f in CSV_FIELDS), doc["ideal"]["hit_rate"]))
