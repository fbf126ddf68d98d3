"""The Mooncake paper's Fig. 9 on the full synthetic trace (skipped where the
traces are absent: set ``PAGEDKV_TRACES`` to their folder; without it
``../shared/traces`` beside the repository is used where it exists, as on CI;
bench/locations.py, docs/simulate.md)."""

from __future__ import annotations

import pytest

from bench.locations import SYNTHETIC_TRACE, mooncake_trace
from pagedkv.simulate.analysis import analyze
from pagedkv.simulate.capacity import parse_capacities, single_group_config
from pagedkv.simulate.fleet import run_fleet
from pagedkv.simulate.requests import PrefixHasher, TokenSource
from pagedkv.simulate.workload import load_workload

SYNTHETIC = mooncake_trace(SYNTHETIC_TRACE)

# Read off the paper's Fig. 9 (the traces' README), synthetic trace.
PAPER = {"1e6": 0.15, "3e6": 0.30, "1e7": 0.59, "5e7": 0.66}


@pytest.mark.skipif(not SYNTHETIC.is_file(),
                    reason=f"no Mooncake trace at {SYNTHETIC}: set PAGEDKV_TRACES to the traces' folder")
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
