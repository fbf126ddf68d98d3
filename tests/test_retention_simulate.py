"""``pagedkv simulate --policy``: the retention simulator's CLI on a hand-made
trace (src/pagedkv/simulate/retention_cli.py): priorities, pins under a budget
(RET-6: refused whole), tenant quotas (RET-8) and malformed retention files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.simulate.cli import main as simulate_main
from pagedkv.simulate.retention_cli import Annotations, load_annotations
from pagedkv.simulate.retention_model import Request, Workload, system_prompt_workload
from pagedkv.spec.errors import InvalidRetentionError


def _trace(tmp_path: Path) -> Path:
    """40 requests: a hot 3-block chain every 4th request, unique chains between."""
    lines = []
    unique = 1000
    for index in range(40):
        if index % 4 == 0:
            blocks = [1, 2, 3]
        else:
            blocks = list(range(unique, unique + 3))
            unique += 3
        lines.append(json.dumps({"input_length": 3 * 512 + 1, "hash_ids": blocks}))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_priority_keeps_the_hot_chain_and_lru_and_min_always_run(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    retention = tmp_path / "r.json"
    retention.write_text(json.dumps({"directives": [{"blocks": [1, 2, 3], "priority": 90}]}))
    code = simulate_main([str(_trace(tmp_path)), "--policy", "priority", "--retention", str(retention),
                          "--fractions", "0.05"])
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"lru", "priority", "min"} <= set(rows)
    hit = {name: float(rows[name].split("|")[2]) for name in ("lru", "priority", "min")}
    assert hit["lru"] < hit["priority"] <= hit["min"]


def test_pins_past_the_budget_are_refused_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    retention = tmp_path / "r.json"
    retention.write_text(json.dumps({"directives": [{"blocks": [1, 2, 3], "pin": True}]}))
    trace = str(_trace(tmp_path))
    assert simulate_main([trace, "--policy", "lru+pin", "--retention", str(retention), "--fractions", "0.05"]) == 0
    assert "1 pin directive(s) refused" in capsys.readouterr().out  # budget 0: pins off
    assert simulate_main([trace, "--policy", "lru+pin", "--retention", str(retention), "--fractions", "0.05",
                          "--pin-budget", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "refused" not in out
    rows = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in out.splitlines() if line.startswith("| ")
            and not line.startswith("| policy")}
    assert rows["lru"] < rows["lru+pin"]


def test_tenant_quota_runs_and_bad_input_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(_trace(tmp_path))
    assert simulate_main([trace, "--policy", "priority", "--tenant-quota", "1", "--fractions", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "| lru |" in out and "| priority+quota |" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"directives": [{"blocks": [1], "priority": 101}]}))
    assert simulate_main([trace, "--policy", "priority", "--retention", str(bad)]) == 2
    assert "directives[0].priority" in capsys.readouterr().err
    assert simulate_main([trace, "--policy", "belady"]) == 2


def test_directives_resolve_with_the_max_rule() -> None:
    base = Workload("w", (Request(4 * 512 + 1, (10, 11, 12, 13)),), working_set=4)
    workload = system_prompt_workload(base, prefix_blocks=2)
    found = load_annotations({"directives": [{"prefix": True, "priority": 90}, {"request": 0, "priority": 50},
                                             {"prefix": True, "pin": True}]}, workload)
    assert found.priority[0] == found.priority[1] == 90 and found.priority[workload.requests[0].blocks[-1]] == 50
    assert found.pins_within(1) == (frozenset(), 1)
    assert Annotations(pin_groups=[[1], [2, 3]]).pins_within(2) == (frozenset({1}), 1)
    with pytest.raises(InvalidRetentionError, match=r"directives\[0\]: name a target"):
        load_annotations({"directives": [{"priority": 5}]}, workload)
