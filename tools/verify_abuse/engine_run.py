"""One engine under the abuse workload: start the server, send the phases, read the pool, stop.

The result is plain data (JSON-able): every call's outcome, the pool as the probe scheduler saw it
at the idle points after the load drained and at the end, vLLM's /metrics, the server's liveness.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import client as cl
import plan as pl
import server as sv

IDLE_WAIT_S = 30.0
FLUSH_EVERY_S = 5.0
ABUSE_PHASES = ("bad", "features", "load", "burst")


def _state(server: sv.Server) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(server.state_path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def _flush(server: sv.Server) -> cl.Outcome:
    """A one-token request sent once the clients are done: the engine runs one more step, so the
    aborts it was sent have been handled and /metrics shows the state after them."""
    call = pl.Call(name="flush", phase="flush", kind="flush", body=pl._completion([5, 6, 7], 1))
    return cl.send(call, server.port, server.model)


def wait_idle(server: sv.Server) -> dict[str, Any]:
    """The probe's idle reading taken after a flush request, with vLLM's metrics at that point.
    Flushes again every FLUSH_EVERY_S until the scheduler reports idle or IDLE_WAIT_S pass."""
    deadline = time.monotonic() + IDLE_WAIT_S
    time.sleep(0.5)
    before = int(_state(server).get("idle_points", 0))
    flushes = [_flush(server).result]
    last_flush = time.monotonic()
    state = _state(server)
    while True:
        state = _state(server)
        # An idle point newer than the flush's start, and nothing scheduled after it.
        if int(state.get("idle_points", 0)) > before and not state.get("pending"):
            break
        if time.monotonic() > deadline:
            state["idle"] = None  # never idle again: requests left in the scheduler
            break
        if time.monotonic() - last_flush > FLUSH_EVERY_S:
            flushes.append(_flush(server).result)
            last_flush = time.monotonic()
        time.sleep(0.25)
    return {"flushes": flushes, "idle": state.get("idle"), "pending": state.get("pending"),
            "metrics": sv.metrics(server),
            "aborted_by_status": state.get("aborted_by_status", {}), "resets": state.get("resets", {}),
            "max_used": state.get("max_used", 0), "num_blocks": state.get("num_blocks", 0),
            "manager": state.get("manager", ""), "planted_leak": state.get("planted_leak")}


def clean_calls(workload: pl.Workload) -> list[pl.Call]:
    """Every compared call, as a plain completion (no disconnect), for the clean reference run."""
    calls = [c for phase in workload.phases.values() for c in phase if c.compare]
    calls += pl.after_calls(aborted_calls(workload))
    return [replace(c, action=pl.COMPLETE) for c in calls]


def aborted_calls(workload: pl.Workload, phases: tuple[str, ...] = ABUSE_PHASES) -> list[pl.Call]:
    return [c for name in phases for c in workload.phases[name] if c.action in pl.ABORTING]


def run(variant_cls: str, tag: str, model_dir: str, shape: sv.ServerShape, workload: pl.Workload,
        sizes: pl.Sizes, work: Path, clean_first: bool, log: Any,
        phases: tuple[str, ...] = ABUSE_PHASES) -> dict[str, Any]:
    """The workload on one fresh server: the abuse `phases`, the drain, `after` and `probe`.
    With `clean_first`, the clean reference run goes first on the same fresh engine (then the
    prefix cache is reset at idle)."""
    server = sv.start(variant_cls, model_dir, shape, work, tag)
    result: dict[str, Any] = {"tag": tag, "scheduler": variant_cls, "outcomes": [], "log": str(server.log_path)}
    try:
        t0 = time.monotonic()
        sv.wait_ready(server)
        result["startup_s"] = time.monotonic() - t0
        log(f"  {tag}: server ready in {result['startup_s']:.0f} s (port {server.port})")
        port, model = server.port, server.model
        if clean_first:
            t0 = time.monotonic()
            clean = cl.send_all(clean_calls(workload), port, model, concurrency=shape.max_num_seqs)
            result["clean"] = [o.as_dict() for o in clean]
            reset = cl.send(pl.Call(name="clean/reset", phase="clean", kind="reset", path="/reset_prefix_cache",
                                    body={}), port, model)
            result["clean_reset"] = reset.message
            log(f"  {tag}: clean reference run, {len(clean)} requests in {time.monotonic() - t0:.0f} s, "
                f"then reset at idle: {reset.message}")
        outcomes: list[cl.Outcome] = []
        t_abuse = time.monotonic()
        concurrency_of = {"bad": 1, "features": 8, "load": sizes.concurrency,
                          "burst": len(workload.phases["burst"])}
        for name in phases:
            calls, concurrency = workload.phases[name], concurrency_of[name]
            t0 = time.monotonic()
            got = cl.send_all(calls, port, model, concurrency)
            outcomes += got
            up = server.alive() and _healthy(server)
            log(f"  {tag}: {name}: {len(got)} calls in {time.monotonic() - t0:.1f} s; "
                f"{_tally(got)}; server {'up' if up else 'DOWN'}")
            if not up:
                break
        result["abuse_s"] = time.monotonic() - t_abuse
        if server.alive() and _healthy(server):
            result["drained"] = wait_idle(server)
            after = cl.send_all(pl.after_calls(aborted_calls(workload, phases)), port, model, 1)
            probe = cl.send_all(workload.phases["probe"], port, model, 1)
            outcomes += after + probe
            log(f"  {tag}: after: {len(after)} prompts of disconnected requests again, probe: {len(probe)} "
                f"calls; {_tally(after + probe)}")
            result["final"] = wait_idle(server)
        result["outcomes"] = [o.as_dict() for o in outcomes]
        result["alive"] = server.alive() and _healthy(server)
    finally:
        result["alive_at_stop"] = server.alive()
        sv.stop(server)
    return result


def _healthy(server: sv.Server) -> bool:
    try:
        with urllib.request.urlopen(f"{server.base}/health", timeout=10) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _tally(outcomes: list[cl.Outcome]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        key = o.result if o.result != cl.REFUSED else f"refused {o.status}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
