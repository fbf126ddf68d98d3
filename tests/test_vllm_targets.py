"""bench/vllm_targets.py's verdicts: each row compares the right ratio with
the right bound (the workloads themselves need vLLM and run under ``make
bench BENCH_ARGS=--vllm``; here they are replaced by fixed figures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import request_bench, vllm_targets
from bench import vllm_side_by_side as sbs


def _fixed(vllm: float, ours: float) -> dict[str, dict[str, float]]:
    keys = ("get_computed_blocks", "allocate_slots", "free", "manager_ms", "manager_and_creation_ms",
            "make_request")
    return {"vllm": dict.fromkeys(keys, vllm), "pagedkv": dict.fromkeys(keys, ours)}


def test_rows_compare_ratios_with_their_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ratios = {"llama3": 6.0, "gemma3": 4.0, "jamba": 5.5}
    monkeypatch.setattr(sbs, "standard_side_by_side",
                        lambda python, model, *rest: _fixed(ratios[model], 1.0))
    # Long prompts: 4x everywhere; pagedkv's cost per block grows 1.2x (flat) for all but free (2x).
    def long(python: str, lengths: Any, *rest: Any, **options: Any) -> dict[int, Any]:
        out = {}
        for index, length in enumerate(lengths):
            figures = _fixed(4.0 * (1 + 0.2 * index / (len(lengths) - 1)), 1 + 0.2 * index / (len(lengths) - 1))
            figures["pagedkv"]["free"] = 1.0 + index / (len(lengths) - 1)
            figures["vllm"]["free"] = 4.0 * figures["pagedkv"]["free"]
            out[length] = figures
        return out
    monkeypatch.setattr(sbs, "long_prompts_side_by_side", long)
    monkeypatch.setattr(request_bench, "run", lambda quick, vllm_python=None: {"ns_per_token": {
        f"{ours}/{size}": {"pagedkv": 10.0, "vllm": 14.0 if size == 512 else 20.0}
        for ours, _ in request_bench.HASH_PAIRS for size in request_bench.BLOCK_SIZES}})
    monkeypatch.setattr(sbs, "mooncake_side_by_side",
                        lambda python, path, block_size, *rest: _fixed(4.5 if block_size == 16 else 2.5, 1.0))
    python = tmp_path / "python"
    python.touch()
    monkeypatch.setattr(vllm_targets, "TRACE", python)  # any existing file
    rows = {label: (value, target, met) for label, value, target, met in vllm_targets.run(str(python), runs=1)}
    assert rows["standard trace, llama3: manager total"] == (6.0, 5.0, True)
    assert rows["standard trace, gemma3: manager total"] == (4.0, 5.0, False)
    assert rows["standard trace, gemma3: free"] == (4.0, 3.0, True)
    assert rows["long prompts, L=128k: free per block"][2]
    assert rows["long prompts: pagedkv get_computed_blocks per block, 128k over 1k (at most)"][2]
    assert not rows["long prompts: pagedkv free per block, 128k over 1k (at most)"][2]  # 2x: not flat
    assert rows["request creation, block 16: sha256 vs vLLM sha256"][2]
    assert not rows["request creation, block 512: xxh3_128 vs vLLM xxhash"][2]  # 1.4x
    assert rows["Mooncake, block 16, first 2000, sha256: manager total"] == (4.5, 4.0, True)
    assert rows["Mooncake, block 512, all, fast: manager total"] == (2.5, 5.0, False)
    assert rows["Mooncake, block 512, all, sha256: manager + request creation"][2]  # 2.5 >= 2
    assert not rows["Mooncake, block 512, all, fast: manager + request creation"][2]  # 2.5 < 3
