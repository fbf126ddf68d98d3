"""The soak: the abuse mix, round after round on one server, until a fixed number of requests.

Each round is the workload of seed `seed + round` (bad requests, features, load with disconnects
and resets, burst), then a drain. Sampled meanwhile, once a second: the resident memory of the
server and its engine process (all descendants of `vllm serve`); from the probe scheduler: the
used blocks (at most every 0.25 s) and the used blocks at each round's idle point. Checks:
- every idle point has 0 used blocks (by the manager's counters and by /metrics), no 5xx, hung or
  broken call, every bad request refused with a 4xx;
- flat: after the warm-up (the first 40% of the rounds), the median RSS of the last 20% of the samples is
  within 5% of the median of the first 20%; the same for the used blocks at the rounds' drains
  (under load, used blocks follow the phases of each round, not a leak: their mean per round is
  reported and plotted, not judged).
Writes `soak-<variant>.json` to the results folder and the plot with plot.py (matplotlib, in the
dev venv: `make verify-abuse-soak` runs it there).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import client as cl
import engine_run
import plan as pl
import server as sv
import verdict as vd

SAMPLE_S = 1.0
FLAT_TOLERANCE = 0.05
WARM_UP_SHARE = 0.4


class Sampler(threading.Thread):
    """RSS of the server's process tree, once every SAMPLE_S seconds, until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int]] = []  # (wall time, KiB)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.samples.append((time.time(), sum(sv.tree_rss_kib(self.pid).values())))
            self._stop_event.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def flatness(values: list[float]) -> tuple[float, float]:
    """(median of the first 20%, median of the last 20%) of `values`."""
    k = max(1, len(values) // 5)
    return statistics.median(values[:k]), statistics.median(values[-k:])


def main(variant_cls: str, variant: str, model_dir: str, shape: sv.ServerShape, sizes: pl.Sizes, seed: int,
         requests: int, work: Path, results: Path, log: Any) -> int:
    server = sv.start(variant_cls, model_dir, shape, work, f"soak-{variant}")
    failures: list[str] = []
    rounds: list[dict[str, Any]] = []
    sampler = Sampler(server.proc.pid)
    try:
        sv.wait_ready(server)
        sampler.start()
        t_start = time.time()
        sent = 0
        r = 0
        while sent < requests and server.alive():
            workload = pl.build(seed + r, sizes, shape.max_model_len, shape.block_size, shape.usable_tokens)
            calls = {c.name: c for phase in workload.phases.values() for c in phase}
            outcomes: list[cl.Outcome] = []
            t0 = time.time()
            for name in engine_run.ABUSE_PHASES:
                concurrency = {"bad": 1, "features": 8, "load": sizes.concurrency}.get(name, 64)
                outcomes += cl.send_all(workload.phases[name], server.port, server.model, concurrency)
            idle = engine_run.wait_idle(server)
            sent += len(outcomes)
            round_failures: list[str] = []
            for o in outcomes:
                call = calls[o.name]
                if o.result in (cl.SERVER_ERROR, cl.HUNG, cl.BROKEN):
                    round_failures.append(f"{o.name}: {o.result} {o.status} {o.message[:120]}")
                elif call.expect == "4xx" and o.result != cl.REFUSED:
                    round_failures.append(f"{o.name}: expected a 4xx, got {o.result}")
            leaked = vd._leak(idle, round_failures, f"round {r} drained")
            by_pid = sv.tree_rss_kib(server.proc.pid)
            rss = sum(by_pid.values())
            rounds.append({"round": r, "t": t0 - t_start, "seconds": time.time() - t0, "sent": len(outcomes),
                           "leaked_blocks": leaked, "rss_kib_idle": rss, "rss_kib_by_process": {
                               sv.process_name(pid): kib for pid, kib in by_pid.items()},
                           "aborted_in_engine": idle.get("aborted_by_status", {}),
                           "preemptions": idle["metrics"].get("vllm:num_preemptions_total", 0)})
            failures += [f"round {r}: {f}" for f in round_failures]
            log(f"  soak round {r}: {len(outcomes)} calls in {time.time() - t0:.0f} s (total {sent}), leaked "
                f"{leaked}, RSS {rss / 1024:.0f} MiB, {len(round_failures)} failures")
            r += 1
        if not server.alive():
            failures.append(f"server died (log {server.log_path})")
        state = engine_run._state(server)
    finally:
        sampler.stop()
        sv.stop(server)

    # Flatness after the warm-up: the first WARM_UP_SHARE of the rounds. vLLM's engine process
    # grows for a while under this mix, stock as pagedkv (docs/vllm-engine.md: +42, +31, +18, +12
    # MiB per round on stock), less each round; the check is for growth that does not settle.
    n_warm = max(1, round(WARM_UP_SHARE * len(rounds)))
    warm = rounds[n_warm]["t"] + t_start if len(rounds) > n_warm else t_start
    rss = [kib for t, kib in sampler.samples if t >= warm]
    probe_start = float(state.get("started_at", 0.0))
    used = [(probe_start + t, u) for t, u, _running, _waiting in state.get("series", [])]
    used_under_load = [u for t, u in used if t >= warm]
    summary: dict[str, Any] = {"variant": variant, "requests": sum(x["sent"] for x in rounds), "rounds": rounds,
                               "seconds": time.time() - t_start, "num_blocks": shape.num_blocks}
    if len(rss) >= 10 and len(used_under_load) >= 10:
        first, last = flatness([float(x) for x in rss])
        summary["rss_mib_first_last"] = [first / 1024, last / 1024]
        if abs(last - first) > FLAT_TOLERANCE * first:
            failures.append(f"RSS not flat: {first / 1024:.0f} MiB -> {last / 1024:.0f} MiB after warm-up")
        # Used blocks: the floor the pool returns to at each round's drain (under load they follow
        # the phases of the round, not a leak; their per-round means are reported).
        drains = [float(x["leaked_blocks"] or 0) for x in rounds[n_warm:]]
        u_first, u_last = flatness(drains)
        summary["used_blocks_at_drain_first_last"] = [u_first, u_last]
        if abs(u_last - u_first) > FLAT_TOLERANCE * max(u_first, 1.0):
            failures.append(f"used blocks at the drains not flat: {u_first:.1f} -> {u_last:.1f}")
        bounds = [x["t"] + t_start for x in rounds] + [time.time()]
        summary["used_blocks_mean_by_round"] = [round(statistics.mean([u for t, u in used if lo <= t < hi] or [0]), 1)
                                                for lo, hi in zip(bounds, bounds[1:])]
    else:
        failures.append(f"too few samples after warm-up ({len(rss)} RSS, {len(used_under_load)} used blocks): "
                        "run more requests")
    summary["leaked_blocks_max"] = max((x["leaked_blocks"] or 0 for x in rounds), default=None)
    summary["failures"] = failures
    summary["rss_samples"] = [(t - t_start, kib) for t, kib in sampler.samples]
    summary["used_samples"] = [(t - t_start, u) for t, u in used]
    summary["warm_up_s"] = warm - t_start
    out = results / f"soak-{variant}.json"
    out.write_text(json.dumps(summary, indent=1))
    log(f"soak {variant}: {summary['requests']} requests in {summary['seconds']:.0f} s, {len(rounds)} rounds; "
        f"RSS MiB first/last 20% {_pair(summary.get('rss_mib_first_last'))}, used blocks at the drains "
        f"{_pair(summary.get('used_blocks_at_drain_first_last'))}, mean used blocks by round "
        f"{summary.get('used_blocks_mean_by_round')}, max leaked {summary['leaked_blocks_max']}; {out}")
    try:
        import plot

        log(f"plot: {plot.plot(out)}")
    except ImportError:
        log("plot: matplotlib is not in this venv; `make verify-abuse-soak` plots with the dev venv")
    if failures:
        log("SOAK FAILED:\n  " + "\n  ".join(failures[:40]))
        return 1
    log("SOAK OK: flat, nothing leaked, no 5xx")
    return 0


def _pair(xs: list[float] | None) -> str:
    return "-" if not xs else f"{xs[0]:.1f} -> {xs[1]:.1f}"
