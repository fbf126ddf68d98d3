"""Every side-by-side figure against vLLM 0.33 in one run, checked against
pagedkv's speed targets against it, with one summary table.

    .venv/bin/python -m bench.vllm_targets [--runs N] [--quick] [--vllm-python PATH]
    make bench BENCH_ARGS=--vllm            # the same, after make bench's own sections

It runs, in this order, each workload of :mod:`bench.vllm_side_by_side` (the
sides alternating, medians) and :mod:`bench.request_bench`:

- the standard chat trace on ``llama3``, ``gemma3`` and ``jamba`` (Mamba
  ``align``): every call kind >= 3x vLLM and the manager total >= 5x;
- long prompts, block 16, L = 1k, 8k, 32k, 128k: ``get_computed_blocks``,
  ``allocate_slots`` and ``free`` each >= 3x vLLM per block at every L, and
  pagedkv's cost per block at 128k within 1.3x of its cost at 1k;
- request creation, prompt hashing included, at block sizes 16 and 512,
  ``sha256`` against vLLM's ``sha256`` and ``xxh3_128`` against vLLM's
  ``xxhash``: >= 1.5x;
- the Mooncake conversation trace one request at a time, pool never
  evicting, block 512 (all requests) and block 16 (the first 2,000; with
  ``--quick`` the first 2,000 and 500): manager total >= 5x at 512 and >= 4x
  at 16; manager + request creation >= 2x with ``sha256`` and >= 3x with the
  fast hash at both.

Every row of the summary names its target and says whether this run met
it. Ratios are vLLM time over pagedkv time, so higher is better. The machine
is shared and noisy: read a ratio near its target as not settled.
``--quick`` takes one run of each and shorter traces (a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import request_bench
from bench import vllm_side_by_side as sbs
from bench.locations import mooncake_trace, vllm_python
from pagedkv.optimized.native import build_name
from pagedkv.trace import STANDARD

__all__ = ["run", "main"]

TRACE = mooncake_trace()
"""The Mooncake conversation trace (``$PAGEDKV_TRACES`` or ../shared/traces; ``bench/locations.py``)."""
LENGTHS = (1024, 8192, 32768, 131072)
MODELS = ("llama3", "gemma3", "jamba")

Row = tuple[str, float, float, bool]
"""(what, ratio or value, target, met)."""


def _at_least(label: str, ratio: float, target: float) -> Row:
    return (label, ratio, target, ratio >= target)


def _standard(python: str, runs: int) -> list[Row]:
    rows: list[Row] = []
    for model in MODELS:
        figures = sbs.standard_side_by_side(python, model, "sha256", runs, STANDARD.num_requests)
        theirs, ours = figures["vllm"], figures["pagedkv"]
        for kind in sbs.KINDS:
            rows.append(_at_least(f"standard trace, {model}: {kind}", theirs[kind] / ours[kind], 3.0))
        rows.append(_at_least(f"standard trace, {model}: manager total",
                              theirs["manager_ms"] / ours["manager_ms"], 5.0))
    return rows


def _long(python: str, runs: int, quick: bool) -> list[Row]:
    lengths = LENGTHS[:2] if quick else LENGTHS
    figures = sbs.long_prompts_side_by_side(python, lengths, "sha256", runs, repeats=2 if quick else 4)
    rows: list[Row] = []
    for length in lengths:
        theirs, ours = figures[length]["vllm"], figures[length]["pagedkv"]
        for kind in sbs.KINDS:
            rows.append(_at_least(f"long prompts, L={length // 1024}k: {kind} per block",
                                  theirs[kind] / ours[kind], 3.0))
    first, last = figures[lengths[0]]["pagedkv"], figures[lengths[-1]]["pagedkv"]
    for kind in sbs.KINDS:
        flat = last[kind] / first[kind]
        rows.append((f"long prompts: pagedkv {kind} per block, {lengths[-1] // 1024}k over 1k (at most)",
                     flat, 1.3, flat <= 1.3))
    return rows


def _creation(python: str, quick: bool) -> list[Row]:
    figures = request_bench.run(quick, vllm_python=python)["ns_per_token"]
    rows: list[Row] = []
    for (ours_fn, vllm_fn) in request_bench.HASH_PAIRS:
        for block_size in request_bench.BLOCK_SIZES:
            cell = figures[f"{ours_fn}/{block_size}"]
            rows.append(_at_least(f"request creation, block {block_size}: {ours_fn} vs vLLM {vllm_fn}",
                                  cell["vllm"] / cell["pagedkv"], 1.5))
    return rows


def _mooncake(python: str, runs: int, quick: bool) -> list[Row]:
    rows: list[Row] = []
    for block_size, limit, manager_target in ((512, 500 if quick else None, 5.0), (16, 2000, 4.0)):
        what = f"Mooncake, block {block_size}, {'all' if limit is None else f'first {limit}'}"
        for hash_name, both_target in (("sha256", 2.0), ("fast", 3.0)):
            figures = sbs.mooncake_side_by_side(python, str(TRACE), block_size, limit, hash_name, runs)
            theirs, ours = figures["vllm"], figures["pagedkv"]
            rows.append(_at_least(f"{what}, {hash_name}: manager total",
                                  theirs["manager_ms"] / ours["manager_ms"], manager_target))
            rows.append(_at_least(f"{what}, {hash_name}: manager + request creation",
                                  theirs["manager_and_creation_ms"] / ours["manager_and_creation_ms"],
                                  both_target))
    return rows


def run(vllm_python: str, runs: int = 3, quick: bool = False) -> list[Row]:
    """Every workload in turn; prints each table, then the summary; returns the rows."""
    if not Path(vllm_python).exists():
        raise SystemExit(f"no vLLM interpreter at {vllm_python}: run `make vllm-venv` (vLLM 0.33 on CPU "
                         "at $VLLM_VENV), or pass --vllm-python")
    started = time.perf_counter()
    runs = 1 if quick else runs
    rows = _standard(vllm_python, runs)
    rows += _long(vllm_python, runs, quick)
    rows += _creation(vllm_python, quick)
    if TRACE.exists():
        rows += _mooncake(vllm_python, runs, quick)
    else:
        print(f"\n(no Mooncake trace at {TRACE}: its rows are left out; set PAGEDKV_TRACES to the traces' folder)")
    print(f"\n## Side by side with vLLM 0.33: the targets ({runs} alternating run(s) each, "
          f"{build_name()} build, {time.perf_counter() - started:.0f} s)")
    print("| figure | vLLM / pagedkv (or as named) | target | met |\n|---|---|---|---|")
    for label, value, target, met in rows:
        bound = "≤" if "(at most)" in label else "≥"
        print(f"| {label.replace(' (at most)', '')} | {value:.2f} | {bound} {target:g} | {'yes' if met else 'NO'} |")
    print(f"{sum(met for *_, met in rows)} of {len(rows)} targets met")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments and run the suite."""
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_targets",
                                     description=(__doc__ or "").split("\n\n")[0])
    default_python = vllm_python()
    parser.add_argument("--vllm-python", default=default_python, metavar="PATH",
                        help=f"the python of a virtual environment with vLLM 0.33 (default {default_python})")
    parser.add_argument("--runs", type=int, default=3, metavar="N", help="alternating runs per workload (default 3)")
    parser.add_argument("--quick", action="store_true", help="one run each, shorter traces (a smoke run)")
    args = parser.parse_args(argv)
    run(args.vllm_python, max(1, args.runs), args.quick)
    print("reproduce: .venv/bin/python -m bench.vllm_targets " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

