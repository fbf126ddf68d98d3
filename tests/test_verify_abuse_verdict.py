"""The abuse check's verdict (tools/verify_abuse/verdict.py) has teeth, without a server.

`make verify-abuse` needs the engine venv and a quarter of an hour; its judgement is plain data in,
failures out. A run that passes is built here, then each fault the check exists for is planted in
it once: a leaked block, a request left in the scheduler, a broken invariant, a 5xx, a bad request
answered 200, an output that differs from the clean run, a different probe hit on one engine.
"""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools" / "verify_abuse"


@pytest.fixture(scope="module")
def tools() -> Iterator[tuple[ModuleType, ModuleType]]:
    """verdict.py and plan.py, imported from the tools folder (their imports are by plain name)."""
    sys.path.insert(0, str(TOOLS))
    try:
        yield importlib.import_module("verdict"), importlib.import_module("plan")
    finally:
        sys.path.remove(str(TOOLS))
        for name in ("verdict", "plan", "client"):
            sys.modules.pop(name, None)


def _reading(used: int = 0, usage: float = 0.0, invariants: str = "ok", known: int = 0) -> dict[str, Any]:
    return {"idle": {"t": 1.0, "free_blocks": 39 - used, "used_blocks": used, "known_requests": known,
                     "request_tables": known, "referenced_blocks": used, "invariants": invariants},
            "pending": [], "metrics": {"vllm:kv_cache_usage_perc": usage}, "num_blocks": 40,
            "aborted_by_status": {"RUNNING": 1}, "resets": {"ok": 1}, "max_used": 12, "manager": "x"}


def _outcome(name: str, phase: str, kind: str, result: str, status: int | None, message: str = "",
             tokens: dict[str, list[int]] | None = None, cached: int = -1) -> dict[str, Any]:
    return {"name": name, "phase": phase, "kind": kind, "result": result, "status": status, "message": message,
            "tokens": tokens or {}, "finish": {}, "cached": cached, "seconds": 0.1}


def _passing(plan: ModuleType) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(run, calls by name, clean outcomes by name) of a run that passes."""
    calls = {
        "bad/empty": plan.Call(name="bad/empty", phase="bad", kind="bad/empty", expect="4xx"),
        "load/0": plan.Call(name="load/0", phase="load", kind="completed", compare=True),
        "load/1": plan.Call(name="load/1", phase="load", kind="disconnect", action=plan.CLOSE_AFTER_TOKENS,
                            close_after=2),
        "probe/reset at idle": plan.Call(name="probe/reset at idle", phase="probe", kind="reset"),
        "probe/0-0": plan.Call(name="probe/0-0", phase="probe", kind="probe", compare=True),
    }
    outcomes = [
        _outcome("bad/empty", "bad", "bad/empty", "refused", 400, "You must pass at least one prompt"),
        _outcome("load/0", "load", "completed", "completed", 200, tokens={"0": [5, 6, 7]}),
        _outcome("load/1", "load", "disconnect", "aborted", 200, tokens={"0": [8, 9]}),
        _outcome("probe/reset at idle", "probe", "reset", "completed", 200, "success=True"),
        _outcome("probe/0-0", "probe", "probe", "completed", 200, tokens={"0": [4]}, cached=64),
    ]
    run = {"outcomes": outcomes, "alive": True, "drained": _reading(), "final": _reading(), "log": "x"}
    clean = {o["name"]: copy.deepcopy(o) for o in outcomes if calls[o["name"]].compare}
    return run, calls, clean


def test_a_clean_run_passes(tools: tuple[ModuleType, ModuleType]) -> None:
    verdict, plan = tools
    run, calls, clean = _passing(plan)
    v = verdict.judge(run, calls, clean)
    assert v["failures"] == []
    assert (v["sent"], v["completed"], v["aborted"], v["refused"]) == (5, 3, 1, {"400": 1})
    assert v["leaked_blocks"] == 0 and v["differing_outputs"] == 0 and v["probe_cached"] == [64]
    assert verdict.compare(run, copy.deepcopy(run), v, verdict.judge(copy.deepcopy(run), calls, clean)) == []


@pytest.mark.parametrize("fault, expected", [
    ("leaked block", "1 blocks still used"),
    ("leak seen only by /metrics", "kv_cache_usage_perc"),
    ("request left in the scheduler", "never became idle"),
    ("request still known to the manager", "still knows 1 requests"),
    ("broken invariant", "check_invariants: InvariantViolation: REQ-1"),
    ("5xx", "5xx 500"),
    ("hung", "hung"),
    ("bad request answered 200", "expected a 4xx"),
    ("refusal without a message", "no message"),
    ("output differs from the clean run", "output differs"),
    ("planned disconnect completed", "planned disconnect"),
    ("server died", "not alive"),
    ("reset at idle refused", "reset_prefix_cache at idle"),
])
def test_each_planted_fault_fails_the_run(tools: tuple[ModuleType, ModuleType], fault: str, expected: str) -> None:
    verdict, plan = tools
    run, calls, clean = _passing(plan)
    by_name = {o["name"]: o for o in run["outcomes"]}
    if fault == "leaked block":
        run["drained"] = _reading(used=1, usage=1 / 39)
    elif fault == "leak seen only by /metrics":
        run["final"] = _reading(usage=1 / 39)
    elif fault == "request left in the scheduler":
        run["drained"]["idle"] = None
    elif fault == "request still known to the manager":
        run["final"] = _reading(known=1)
    elif fault == "broken invariant":
        run["drained"] = _reading(invariants="InvariantViolation: REQ-1: block 7: ref 1, held 0")
    elif fault == "5xx":
        by_name["load/0"].update(result="5xx", status=500, message="EngineCore encountered an issue")
    elif fault == "hung":
        by_name["load/0"].update(result="hung", status=None, message="no answer in 90 s")
    elif fault == "bad request answered 200":
        by_name["bad/empty"].update(result="completed", status=200, message="")
    elif fault == "refusal without a message":
        by_name["bad/empty"]["message"] = " "
    elif fault == "output differs from the clean run":
        by_name["load/0"]["tokens"] = {"0": [5, 6, 8]}
    elif fault == "planned disconnect completed":
        by_name["load/1"]["result"] = "completed"
    elif fault == "server died":
        run["alive"] = False
    elif fault == "reset at idle refused":
        by_name["probe/reset at idle"]["message"] = "success=False"
    failures = verdict.judge(run, calls, clean)["failures"]
    assert any(expected in f for f in failures), failures


def test_engines_that_disagree_are_told_apart(tools: tuple[ModuleType, ModuleType]) -> None:
    verdict, plan = tools
    stock, calls, clean = _passing(plan)
    cand = copy.deepcopy(stock)
    {o["name"]: o for o in cand["outcomes"]}["probe/0-0"]["cached"] = 96  # a stale hit on one engine
    {o["name"]: o for o in cand["outcomes"]}["load/1"].update(result="refused", status=400, message="x")
    diffs = verdict.compare(stock, cand, verdict.judge(stock, calls, clean), verdict.judge(cand, calls, clean))
    assert any(d.startswith("probe_cached") for d in diffs), diffs
    assert any(d.startswith("load/1: aborted 200 on stock, refused 400") for d in diffs), diffs
