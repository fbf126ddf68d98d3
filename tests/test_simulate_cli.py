"""``pagedkv simulate`` on the command line: trace formats, input validation
(line and field named), the table, JSON, CSV and plots, exit codes."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.cli import main as pagedkv_main
from pagedkv.simulate.cli import main
from pagedkv.simulate.workload import SharedPrefix, TraceFormatError, load_workload, read_csv, read_jsonl

DATA = Path(__file__).parent / "data"
CONVERSATION = str(DATA / "mooncake_conversation_excerpt.jsonl")
SYNTHETIC = str(DATA / "mooncake_synthetic_excerpt.jsonl")


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--json", "--no-progress"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def _write(tmp_path: Path, name: str, lines: list[str]) -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(("line", "field", "message"), [
    ('{"timestamp": 0, "input_length": 600, "output_length": 5}', "hash_ids", "missing"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "hash_ids",
     "needs 2 blocks"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, -2]}', "hash_ids", "ids must"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length", ">= 1"),
    ('{"timestamp": 0, "input_length": 600, "output_length": "5", "hash_ids": [1, 2]}', "output_length",
     "got '5'"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "timestamp",
     "non-negative"),
    ('{"timestamp": 0, "input_length": 600,', None, "not valid JSON"),
    ('[1, 2]', None, "JSON object"),
])
def test_jsonl_errors_name_line_and_field(tmp_path: Path, line: str, field: str | None, message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "bad.jsonl", [GOOD, "", line])
    with pytest.raises(TraceFormatError, match=message) as caught:
        read_jsonl(path)
    text = str(caught.value)
    assert "bad.jsonl:3" in text
    if field is not None:
        assert f"field {field!r}" in text
    assert main([path, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:3" in err and message in err
    assert main([path, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "invalid_input"


def test_bailian_sessions_and_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "bailian.jsonl", [
        '{"chat_id": 10, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 40, "output_length": 3, '
        '"type": "text", "turn": 1, "hash_ids": [7, 8, 9]}',
        '{"chat_id": 11, "parent_chat_id": 10, "timestamp": 2.0, "input_length": 60, "output_length": 3, '
        '"type": "text", "turn": 2, "hash_ids": [7, 8, 9, 12]}',
        '{"chat_id": 12, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 16, "output_length": 1, '
        '"type": "text", "turn": 1, "hash_ids": [3]}',
    ])
    workload = read_jsonl(path)
    assert workload.block_tokens == 16
    assert [r.arrival_ms for r in workload.requests] == [500.0, 1500.0, 2000.0]
    assert [r.session for r in workload.requests] == [12, 10, 10]
    doc = _json(capsys, path, "--mode", "cache", "--capacity", "inf")
    assert doc["workload"]["sessions"] == 2 and doc["ideal"]["block_size"] == 16
    # The second turn hits its first turn's two full blocks (the third is partial there).
    assert doc["runs"][0]["hit_tokens"] == 32 == doc["ideal"]["hit_rate"] * 116
    bad = _write(tmp_path, "bad.jsonl", ['{"chat_id": 1, "parent_chat_id": "x", "timestamp": 0, '
                                         '"input_length": 16, "output_length": 1, "hash_ids": [1]}'])
    with pytest.raises(TraceFormatError, match="bad.jsonl:1: field 'parent_chat_id'"):
        read_jsonl(bad)


def test_csv_traces_azure_and_burstgpt(tmp_path: Path) -> None:
    azure = _write(tmp_path, "azure.csv", [
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "2023-11-16 18:15:46.6805900,100,10",
        "2023-11-16 18:15:47.1805900,40,5",
        "2023-11-16 18:15:46.1805900,300,1",
    ])
    workload = read_csv(azure)
    assert [r.input_length for r in workload.requests] == [300, 100, 40]
    assert [r.arrival_ms for r in workload.requests] == pytest.approx([0.0, 500.0, 1000.0])
    ids = [set(r.block_ids) for r in workload.requests]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2])  # no prefix information: all unique
    shared = read_csv(azure, SharedPrefix(tokens=64, groups=1))
    assert shared.requests[0].block_ids[:4] == shared.requests[1].block_ids[:4] == (0, 1, 2, 3)
    assert shared.requests[2].block_ids == (0, 1, 2)  # 40 tokens: all prefix
    burst = _write(tmp_path, "burst.csv", [
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
        "5,ChatGPT,472,18,490,Conversation log", "7,ChatGPT,0,0,0,Conversation log",
        "9,GPT-4,1000,12,1012,API log"])
    workload = load_workload(burst)
    assert [(r.arrival_ms, r.input_length, r.output_length) for r in workload.requests] == [
        (0.0, 472, 18), (4000.0, 1000, 12)]
    bad = _write(tmp_path, "bad.csv", ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                                       "5,ChatGPT,472,18,490,x", "6,ChatGPT,many,18,490,x"])
    with pytest.raises(TraceFormatError, match="bad.csv:3: field 'Request tokens'"):
        read_csv(bad)
    unknown = _write(tmp_path, "unknown.csv", ["a,b,c", "1,2,3"])
    with pytest.raises(TraceFormatError, match="unknown CSV columns"):
        read_csv(unknown)


def test_csv_with_shared_prefix_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
        f"2024-05-10 00:00:{i:02d}.0000000,{600 + 37 * i},{4 + i % 5}" for i in range(40)]
    path = _write(tmp_path, "azure.csv", rows)
    doc = _json(capsys, path, "--shared-prefix", "512", "--prefix-groups", "2", "--mode", "cache",
                "--capacity", "inf")
    # Each of the two system prompts misses once; then 512 tokens hit per request.
    assert doc["ideal"]["hit_rate"] == pytest.approx(38 * 512 / sum(600 + 37 * i for i in range(40)))
    assert doc["runs"][0]["hit_rate"] == doc["ideal"]["hit_rate"]


def test_table_json_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_csv = tmp_path / "runs.csv"
    assert main([SYNTHETIC, "--mode", "cache", "--capacity", "1e5,0.5x,inf", "--csv", str(out_csv),
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "ideal (unbounded cache" in text and "reuse distance" in text and "90% of ideal" in text
    assert len([line for line in text.splitlines() if line.strip().startswith(("1e5", "0.5x", "inf"))]) == 3
    with open(out_csv, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["capacity"] for row in rows] == ["1e5", "0.5x", "inf"]
    assert float(rows[2]["hit_rate"]) == pytest.approx(float(rows[2]["ideal_hit_rate"]))
    doc = _json(capsys, SYNTHETIC, "--mode", "cache", "--capacity", "inf", "--limit", "50", "--seed", "3")
    assert doc["workload"]["requests"] == 50 and doc["settings"]["seed"] == 3
    assert doc["runs"][0]["hit_rate"] == doc["ideal"]["hit_rate"]
    assert doc["runs"][0]["evicted_blocks"] == 0
    cdf = doc["reuse_distance_tokens"]["cdf"]
    assert all(a[1] <= b[1] for a, b in zip(cdf, cdf[1:])) and cdf[-1][1] == 1.0


def test_engine_fleet_routers_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, CONVERSATION, "--capacity", "2e5", "--replicas", "4", "--router", "all",
                "--limit", "120", "--no-reuse")
    runs = {run["router"]: run for run in doc["runs"]}
    assert set(runs) == {"round-robin", "least-loaded", "prefix-aware"}
    for run in runs.values():
        assert run["replicas"] == 4 and sum(run["requests_per_replica"]) == 120
        assert run["requests_served"] == 120 and run["queue_delay_ms_p50"] is not None
        assert run["load_imbalance"] >= 1.0
    assert runs["prefix-aware"]["hit_rate"] > runs["round-robin"]["hit_rate"]


def test_top_level_command_and_chat_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert pagedkv_main(["simulate", "chat", "--mode", "cache", "--capacity", "inf", "--json",
                         "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["requests"] == 256
    assert doc["ideal"]["hit_rate"] == pytest.approx(248 * 1024 / (256 * 1536))
    assert doc["runs"][0]["hit_rate"] == doc["ideal"]["hit_rate"]


def test_planned_capacity_and_its_errors(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, SYNTHETIC, "--mode", "cache", "--preset", "llama3-8b", "--memory", "8GiB",
                "--block-size", "16", "--limit", "40")
    run = doc["runs"][0]
    # `pagedkv plan` gives llama3-8b 20,480 blocks in 40 GiB (docs/planning.md): 2 MiB a block.
    assert run["num_blocks"] == 4096
    assert doc["settings"]["model"] and doc["ideal"]["block_size"] == 16
    assert main([SYNTHETIC, "--preset", "llama3-8b", "--memory", "1MiB", "--limit", "5"]) == 1
    assert "pagedkv simulate: error:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    ([SYNTHETIC, "--memory", "1GiB"], "--memory needs --preset"),
    ([SYNTHETIC, "--preset", "llama3-8b"], "need --memory"),
    ([SYNTHETIC, "--replicas", "2", "--router", "random"], "--router"),
    ([SYNTHETIC, "--capacity", "lots"], "--capacity"),
    ([SYNTHETIC, "--max-model-len", "100"], "--max-model-len"),
    (["/no/such/trace.jsonl"], "no such file"),
    ([SYNTHETIC, "--num-blocks", "1"], "--num-blocks"),
    ([SYNTHETIC, "--max-num-seqs", "0"], "must be >= 1"),
    ([SYNTHETIC, "--step-ms", "-1"], "must be >= 0"),
])
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    assert main([SYNTHETIC, "--capacity", "1e5,0.25x,inf", "--plot", str(out), "--limit", "60",
                 "--no-progress"]) == 0
    for name in ("hit_rate.png", "occupancy.png", "reuse_cdf.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000
    assert "plots:" in capsys.readouterr().out


def test_plot_without_matplotlib_fails_before_the_replay(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import pagedkv.simulate.plots as plots

    monkeypatch.setattr(plots, "matplotlib_available", lambda: False)
    assert main([SYNTHETIC, "--plot", "out", "--no-progress"]) == 2
    assert "pagedkv[plot]" in capsys.readouterr().err


def test_help_and_progress_without_tqdm(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from pagedkv.simulate.fleet import _progress

    assert main(["--help"]) == 0
    assert "--replicas" in capsys.readouterr().out
    requests = load_workload(SYNTHETIC).requests * 20
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    assert list(_progress(iter(requests), len(requests), "x", enabled=True)) == list(requests)
