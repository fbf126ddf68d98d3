"""The Mooncake paper's Fig. 9 on the full synthetic trace (skipped where the
traces are absent: set ``PAGEDKV_TRACES`` to their folder, default
``../shared/traces`` beside the repository)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedkv.simulate.analysis import analyze
from pagedkv.simulate.capacity import parse_capacities, single_group_config
from pagedkv.simulate.fleet import run_fleet
from pagedkv.simulate.requests import PrefixHasher, TokenSource
from pagedkv.simulate.workload import load_workload

_FOLDER = Path(os.environ.get("PAGEDKV_TRACES", Path(__file__).resolve().parents[1].parent / "shared" / "traces"))
SYNTHETIC = _FOLDER / "mooncake_synthetic_trace.jsonl"

# Read off the paper's Fig. 9 (../shared/traces/README.md), synthetic trace.
PAPER = {"1e6": 0.15, "3e6": 0.30, "1e7": 0.59, "5e7": 0.66}


@pytest.mark.skipif(not SYNTHETIC.is_file(), reason="the Mooncake traces are not present")
def test_synthetic_trace_reproduces_fig9_and_reaches_the_ideal() -> None:
    workload = load_workload(str(SYNTHETIC))
    analysis = analyze(workload, 512, output_blocks=False, reuse=False)
    source, hasher = TokenSource(512), PrefixHasher("xxh3_128", 512, 512, "0")
    for capacity in parse_capacities(",".join([*PAPER, "inf"]), analysis, 512):
        result = run_fleet(workload, single_group_config(capacity.num_blocks, 512), mode="cache",
                           hasher=hasher, source=source)
        rate = result.replicas[0].hit_tokens / analysis.prompt_tokens
        if capacity.label == "inf":
            assert rate == analysis.ideal_hit_rate
        else:
            assert abs(rate - PAPER[capacity.label]) <= 0.03, (capacity.label, rate)
