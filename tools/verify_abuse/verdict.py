"""What must hold after the abuse workload, for one engine and between two.

One engine (`judge`): every bad request refused with a 4xx and a message, no 5xx, no hung or
broken connection, the server alive; every planned disconnect really cut the request short; after
the load drained the pool's used blocks are 0 by pagedkv's (or vLLM's) own counters and by
/metrics, the free count is the pool minus the null block, the manager knows no request and holds
no reference (pagedkv: `check_invariants()` passes); every compared request completed with the
tokens of the clean stock run.

Two engines (`compare`): the same outcome and status for every call, the same counts, and the
same prefix-cache hits on the probe set.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import client as cl
import plan as pl

USAGE = "vllm:kv_cache_usage_perc"


def _by_name(outcomes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["name"]: o for o in outcomes}


def _tokens(o: dict[str, Any]) -> dict[str, list[int]]:
    # JSON turns the choice indices into strings; compare them as such.
    return {str(k): list(v) for k, v in o["tokens"].items()}


def _leak(reading: dict[str, Any] | None, failures: list[str], when: str) -> int | None:
    """Blocks still used at an idle point; None (and a failure) if the engine never got idle."""
    if not reading or not reading.get("idle"):
        pending = (reading or {}).get("pending")
        failures.append(f"{when}: the scheduler never became idle (requests left in it: {pending})")
        return None
    idle = reading["idle"]
    num_blocks = int(reading["num_blocks"])
    used = int(idle["used_blocks"])
    if used:
        failures.append(f"{when}: {used} blocks still used by the manager's own count (free "
                        f"{idle['free_blocks']} of {num_blocks - 1})")
    metric_used = round(float(reading["metrics"].get(USAGE, 0.0)) * (num_blocks - 1))
    if metric_used:
        failures.append(f"{when}: /metrics {USAGE} = {reading['metrics'].get(USAGE)} ({metric_used} blocks)")
    if idle["known_requests"] or idle["request_tables"]:
        failures.append(f"{when}: the manager still knows {idle['known_requests']} requests "
                        f"({idle['request_tables']} block tables)")
    if idle["referenced_blocks"]:
        failures.append(f"{when}: {idle['referenced_blocks']} blocks still referenced")
    if idle["invariants"] not in ("ok", "n/a (stock)"):
        failures.append(f"{when}: check_invariants: {idle['invariants']}")
    return max(used, metric_used)


def judge(run: dict[str, Any], calls: dict[str, pl.Call], clean: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts and failures of one engine's run. `calls`: the workload's calls by name;
    `clean`: the clean stock run's outcomes by name."""
    failures: list[str] = []
    outcomes = run["outcomes"]
    results = Counter(o["result"] for o in outcomes)
    refused = Counter(str(o["status"]) for o in outcomes if o["result"] == cl.REFUSED)
    differing = 0
    for o in outcomes:
        call = calls[o["name"]]
        where = f"{o['name']} ({o['kind']})"
        if o["result"] in (cl.SERVER_ERROR, cl.HUNG, cl.BROKEN):
            failures.append(f"{where}: {o['result']} {o['status']} {o['message'][:160]}")
            continue
        if call.expect == "4xx" and o["result"] != cl.REFUSED:
            failures.append(f"{where}: expected a 4xx, got {o['result']} {o['status']}")
        if o["result"] == cl.REFUSED and not o["message"].strip():
            failures.append(f"{where}: refused with {o['status']} but no message")
        if call.expect == "ok" and o["result"] == cl.REFUSED:
            failures.append(f"{where}: refused {o['status']}: {o['message'][:160]}")
        if call.action in pl.ABORTING and o["result"] != cl.ABORTED and o["result"] != cl.REFUSED:
            failures.append(f"{where}: planned disconnect, but {o['result']}")
        if call.compare and o["result"] == cl.COMPLETED:
            ref = clean.get(o["name"])
            if ref is None or ref["result"] != cl.COMPLETED:
                failures.append(f"{where}: no clean reference ({ref and ref['result']})")
            elif _tokens(o) != _tokens(ref):
                differing += 1
                failures.append(f"{where}: output differs from the clean stock run")
        elif call.compare and call.expect == "ok":
            failures.append(f"{where}: compared request did not complete ({o['result']})")
    if not run.get("alive"):
        failures.append(f"server not alive at the end (log {run.get('log')})")
    leaked = _leak(run.get("drained"), failures, "after the load drained")
    leaked_final = _leak(run.get("final"), failures, "at the end")
    probe = [o["cached"] for o in outcomes if o["phase"] == "probe" and o["kind"] == "probe"]
    reset_at_idle = next((o["message"] for o in outcomes if o["name"] == "probe/reset at idle"), "")
    if reset_at_idle != "success=True":
        failures.append(f"reset_prefix_cache at idle after the load: {reset_at_idle or 'not sent'}")
    drained = run.get("drained") or {}
    metrics = (run.get("final") or drained).get("metrics", {})
    best_of = {o["name"]: f"{o['result']} {o['status']}" for o in outcomes if "best_of" in o["kind"]}
    stopped_early = sum(1 for o in outcomes if o["kind"] == "stop strings" and "stop" in o["finish"].values())
    return {
        "sent": len(outcomes),
        "completed": results[cl.COMPLETED],
        "aborted": results[cl.ABORTED],
        "refused": dict(sorted(refused.items())),
        "5xx": results[cl.SERVER_ERROR],
        "hung": results[cl.HUNG],
        "broken": results[cl.BROKEN],
        "differing_outputs": differing,
        "leaked_blocks": leaked,
        "leaked_blocks_end": leaked_final,
        "free_after_drain": (drained.get("idle") or {}).get("free_blocks"),
        "num_blocks": drained.get("num_blocks"),
        "aborted_in_engine": drained.get("aborted_by_status", {}),
        "resets": drained.get("resets", {}),
        "max_used": drained.get("max_used"),
        "preemptions": int(metrics.get("vllm:num_preemptions_total", 0)),
        "prefix_hits": int(metrics.get("vllm:prefix_cache_hits_total", 0)),
        "probe_cached": probe,
        "best_of": best_of,
        "stop_strings_ended_early": stopped_early,
        "alive": bool(run.get("alive")),
        "manager": drained.get("manager", ""),
        "startup_s": run.get("startup_s"),
        "abuse_s": run.get("abuse_s"),
        "failures": failures,
    }


COMPARED_COUNTS = ("sent", "completed", "aborted", "refused", "5xx", "hung", "differing_outputs", "leaked_blocks",
                   "probe_cached")


def compare(stock: dict[str, Any], cand: dict[str, Any], stock_verdict: dict[str, Any],
            cand_verdict: dict[str, Any]) -> list[str]:
    """Differences between two engines' runs of the same workload (empty: the same)."""
    diffs = []
    a, b = _by_name(stock["outcomes"]), _by_name(cand["outcomes"])
    if a.keys() != b.keys():
        diffs.append(f"different calls: {sorted(a.keys() ^ b.keys())[:5]}")
    for name in a.keys() & b.keys():
        x, y = a[name], b[name]
        if (x["result"], x["status"]) != (y["result"], y["status"]):
            diffs.append(f"{name}: {x['result']} {x['status']} on stock, {y['result']} {y['status']} here")
    for key in COMPARED_COUNTS:
        if stock_verdict[key] != cand_verdict[key]:
            diffs.append(f"{key}: {stock_verdict[key]} on stock, {cand_verdict[key]} here")
    return diffs


ROWS = (
    ("requests sent", "sent"), ("completed", "completed"), ("aborted by the client", "aborted"),
    ("refused (by status)", "refused"), ("5xx", "5xx"), ("hung", "hung"), ("broken connections", "broken"),
    ("differing outputs (vs clean stock)", "differing_outputs"), ("leaked blocks after drain", "leaked_blocks"),
    ("leaked blocks at the end", "leaked_blocks_end"), ("free blocks after drain", "free_after_drain"),
    ("aborts seen by the scheduler (status)", "aborted_in_engine"), ("reset_prefix_cache", "resets"),
    ("preemptions", "preemptions"), ("prefix-cache hits (tokens)", "prefix_hits"),
    ("probe set cached tokens", "probe_cached"), ("best_of", "best_of"),
    ("stop-string requests ended early", "stop_strings_ended_early"), ("max used blocks", "max_used"),
    ("server alive", "alive"), ("failures", "failures"),
)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
    if isinstance(value, list) and value and isinstance(value[0], str):
        return str(len(value))
    if isinstance(value, list):
        return " ".join(str(v) for v in value) or "-"
    return "-" if value is None else str(value)


def table(verdicts: dict[str, dict[str, Any]]) -> str:
    names = list(verdicts)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(verdicts[n].get(key)) for n in names) + " |")
    return "\n".join(lines)
