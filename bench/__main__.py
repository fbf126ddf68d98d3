"""``make bench`` / ``python -m bench``: the manager benchmarks, then the tensor path.

Runs, in order: the standard chat trace (../shared/anchors.md) through the
optimized and the reference manager with the ``sha256`` and the fast
``xxh3_128`` hash; the eviction-heavy variant (a pool just big enough for the
trace's peak); allocate/free micro-benchmarks at 1-1000 blocks in pools of 1k
and 1M blocks; the hybrid models (``bench.hybrid_bench``); long prompts of
1k-128k tokens and the Mamba-align hybrid (``bench.long_bench``); the
Mamba-align hybrid with sub-block hits (``bench.mamba_partial_bench``); then
``bench.tensor_bench.run(quick)`` when that module exists
and torch imports. Prints Markdown tables on stdout (vLLM 0.33's figures and
pagedkv's targets beside ours) and writes everything as JSON under
``bench/results/``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import manager_bench as mb
from bench.locations import vllm_python
from pagedkv.optimized.native import build_name
from pagedkv.trace import STANDARD, TraceConfig, peak_blocks

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# vLLM 0.33's KVCacheManager on this machine kind, and pagedkv's targets (anchors.md).
VLLM = {"manager_total_ms": 348.0, "allocate_slots": 9.8, "get_computed_blocks": 74.0,
        "free": 22.0, "request_sha256": 0.29}
TARGETS = {"manager_total_ms": 70.0, "allocate_slots": 3.3, "get_computed_blocks": 25.0,
           "free": 7.4, "request_xxh3_128": 0.06}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0]
                                     if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="fewer runs and repetitions (a smoke run; figures are noisier)")
    parser.add_argument("--runs", type=int, default=None, metavar="N",
                        help="optimized runs per trace configuration (default 5, --quick 2)")
    parser.add_argument("--reference-runs", type=int, default=None, metavar="N",
                        help="reference runs per trace configuration (default 3, --quick 1)")
    parser.add_argument("--requests", type=int, default=STANDARD.num_requests, metavar="N",
                        help="requests in the trace (default 256: only the default compares with vLLM)")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference manager")
    parser.add_argument("--no-micro", action="store_true", help="skip the allocate/free micro-benchmarks")
    parser.add_argument("--no-eviction", action="store_true", help="skip the eviction-heavy variant")
    parser.add_argument("--no-tensor", action="store_true", help="skip bench/tensor_bench.py")
    parser.add_argument("--no-long", action="store_true",
                        help="skip the long-prompt and Mamba-align sections (bench/long_bench.py, "
                             "bench/mamba_partial_bench.py)")
    parser.add_argument("--vllm", action="store_true",
                        help="last, every side-by-side figure against vLLM 0.33 and its target "
                             "(bench/vllm_targets.py; needs vLLM 0.33 on CPU: make vllm-venv, or $VLLM_PYTHON; "
                             "about 40 minutes, --quick about 10)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, metavar="DIR",
                        help="directory for the JSON results (default bench/results)")
    return parser.parse_args(argv)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _ratio(optimized: float | None, reference: float | None) -> str:
    if optimized is None or reference is None or reference == 0:
        return "–"
    if not optimized:
        return "–"
    speedup = reference / optimized
    return f"{optimized / reference:.3f} ({speedup:.{1 if speedup < 10 else 0}f}× faster)"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(row) for row in rows)])


def _figure(result: dict[str, Any] | None, key: str) -> float | None:
    if result is None:
        return None
    if key == "manager_total_ms":
        return float(result["manager_total_ms"])
    if key == "request":
        return float(result["request_creation_us_per_token"])
    return float(result["us_per_call"][key])


def _summary(trace: dict[str, dict[str, Any]]) -> str:
    sha_o, sha_r = trace["sha256"].get("optimized"), trace["sha256"].get("reference")
    xxh_o, xxh_r = trace["xxh3_128"].get("optimized"), trace["xxh3_128"].get("reference")
    rows = []
    spec = [
        ("manager total on the trace (ms)", "manager_total_ms", "manager_total_ms", "manager_total_ms",
         sha_o, sha_r, 1),
        ("allocate_slots (µs/call)", "allocate_slots", "allocate_slots", "allocate_slots", sha_o, sha_r, 2),
        ("get_computed_blocks (µs/call)", "get_computed_blocks", "get_computed_blocks",
         "get_computed_blocks", sha_o, sha_r, 2),
        ("free (µs/call)", "free", "free", "free", sha_o, sha_r, 2),
        ("request creation, sha256 (µs/token)", "request_sha256", None, "request", sha_o, sha_r, 3),
        ("request creation, xxh3_128 (µs/token)", None, "request_xxh3_128", "request", xxh_o, xxh_r, 3),
    ]
    for label, vllm_key, target_key, key, opt, ref, digits in spec:
        ours, theirs = _figure(opt, key), _figure(ref, key)
        target = TARGETS.get(target_key) if target_key else None
        met = "–" if target is None or ours is None else ("yes" if ours <= target else
                                                           f"NO ({ours / target:.2f}× the target)")
        rows.append([label, _fmt(VLLM.get(vllm_key) if vllm_key else None, digits),
                     "–" if target is None else f"≤ {target:g}", _fmt(ours, digits),
                     _fmt(theirs, digits), _ratio(ours, theirs), met])
    return _table(["figure (hash sha256 unless named)", "vLLM 0.33", "target", "optimized",
                   "reference", "opt/ref", "target met"], rows)


def _detail(results: dict[str, dict[str, Any]]) -> str:
    opt, ref = results.get("optimized"), results.get("reference")
    any_result = opt or ref
    assert any_result is not None
    rows = []
    for kind in ("get_computed_blocks", "allocate_slots", "free", "make_request", "append_token"):
        rows.append([kind, str(any_result["calls"][kind]), _fmt(_figure(opt, kind)),
                     _fmt(_figure(ref, kind)), _ratio(_figure(opt, kind), _figure(ref, kind))])
    rows.append(["manager total (ms)", "", _fmt(_figure(opt, "manager_total_ms"), 1),
                 _fmt(_figure(ref, "manager_total_ms"), 1),
                 _ratio(_figure(opt, "manager_total_ms"), _figure(ref, "manager_total_ms"))])
    return _table(["call (µs/call)", "calls", "optimized", "reference", "opt/ref"], rows)


def _micro_table(micro: list[dict[str, Any]]) -> str:
    by = {(m["implementation"], m["pool_blocks"]): m for m in micro}
    rows = []
    for n in mb.MICRO_BLOCKS:
        for implementation in ("optimized", "reference"):
            cells = [str(n), implementation]
            values = []
            for pool in mb.MICRO_POOLS:
                entry = by.get((implementation, pool), {}).get("sizes", {}).get(str(n))
                values.append(entry)
                cells += ["–", "–"] if entry is None else [_fmt(entry["allocate_us"]), _fmt(entry["free_us"])]
            if all(values):
                small, big = values[0], values[-1]
                assert small is not None and big is not None
                cells.append(f"{big['allocate_us'] / small['allocate_us']:.2f} / "
                             f"{big['free_us'] / small['free_us']:.2f}")
            else:
                cells.append("–")
            if any(v is not None for v in values):
                rows.append(cells)
    header = ["blocks", "impl"]
    for pool in mb.MICRO_POOLS:
        name = f"{pool >> 10}k" if pool < (1 << 20) else f"{pool >> 20}M"
        header += [f"alloc µs ({name} pool)", f"free µs ({name} pool)"]
    header.append("1M/1k alloc / free")
    return _table(header, rows)


def _tensor(quick: bool) -> dict[str, Any] | None:
    if importlib.util.find_spec("bench.tensor_bench") is None:
        print("\n(tensor path: bench/tensor_bench.py not present; skipped)")
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        print("\n(tensor path: torch does not import; skipped)")
        return None
    print("\n## Tensor path (bench/tensor_bench.py)", flush=True)
    module = importlib.import_module("bench.tensor_bench")
    result: dict[str, Any] = module.run(quick)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks; return the exit status."""
    args = _parse(argv)
    quick = bool(args.quick)
    runs = args.runs if args.runs is not None else (2 if quick else 5)
    ref_runs = args.reference_runs if args.reference_runs is not None else (1 if quick else 3)
    config = TraceConfig(num_requests=args.requests)
    impls = [("optimized", runs)] + ([] if args.no_reference else [("reference", ref_runs)])
    command = "cd " + shlex.quote(os.getcwd()) + " && " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.executable), "-m", "bench",
                                 *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.processor(), "cpus": os.cpu_count()},
        "trace_config": {"num_requests": config.num_requests, "num_blocks": 8192,
                         "block_size": config.block_size},
        "vllm_0_33": VLLM, "targets": TARGETS, "pool_loops": build_name(),
    }
    print("# pagedkv bench")
    print(f"reproduce: {command}")
    print(f"machine: Python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs; "
          f"pool loops: {build_name()} (D-PERF-26)")
    print(f"trace: {config.num_requests} requests, 8192 blocks of {config.block_size} tokens; "
          f"optimized median of {runs} runs, reference median of {ref_runs}; "
          "only manager calls are timed (perf_counter_ns around each call)", flush=True)

    trace: dict[str, dict[str, Any]] = {"sha256": {}, "xxh3_128": {}}
    for hash_fn in trace:
        for implementation, n in impls:
            print(f"  trace: {implementation}, {hash_fn}, {n} run(s) ...", file=sys.stderr, flush=True)
            trace[hash_fn][implementation] = mb.run_trace(implementation, hash_fn, n, config)
    report["trace"] = trace
    print("\n## Standard chat trace: pagedkv against vLLM 0.33 and the targets")
    if config != STANDARD:
        print(f"(NOTE: --requests {config.num_requests} is not the standard trace: "
              "vLLM's figures are for 256 requests)")
    print(_summary(trace))
    for hash_fn, results in trace.items():
        print(f"\n### Per call, hash {hash_fn}")
        print(_detail(results))

    if not args.no_eviction:
        num_blocks = mb.eviction_num_blocks(config)
        evicted = mb.count_evictions(config, num_blocks)
        eviction: dict[str, Any] = {"num_blocks": num_blocks, "blocks_evicted": evicted}
        for implementation, n in impls:
            print(f"  eviction-heavy trace: {implementation}, {n} run(s) ...", file=sys.stderr, flush=True)
            eviction[implementation] = mb.run_trace(implementation, "sha256", n, config, num_blocks)
        report["eviction"] = eviction
        print(f"\n## Eviction-heavy variant: {num_blocks} blocks (the trace's peak of "
              f"{peak_blocks(config)} + the null block + a margin), sha256; {evicted} cached "
              "blocks evicted on the way")
        print(_detail(eviction))

    if not args.no_micro:
        micro = []
        for implementation, _ in impls:
            reps = (50 if quick else 300) if implementation == "optimized" else (3 if quick else 10)
            for pool in mb.MICRO_POOLS:
                print(f"  micro: {implementation}, pool {pool} ...", file=sys.stderr, flush=True)
                micro.append(mb.run_micro(implementation, pool, reps=reps))
        report["micro"] = micro
        print("\n## allocate/free micro-benchmarks (prefix caching off; median µs per call; "
              "the last column is 1M-pool cost over 1k-pool cost: ~1 means no growth with pool size)")
        print(_micro_table(micro))

    report["hybrid"] = importlib.import_module("bench.hybrid_bench").run(quick)
    if not args.no_long:
        report["long"] = importlib.import_module("bench.long_bench").run(quick)
        # Mamba block larger than the hash block: sub-block hits with copy-on-write.
        report["mamba_partial"] = importlib.import_module("bench.mamba_partial_bench").run(quick)
    # Request creation beside vLLM's Request (vLLM's side only where the vLLM venv exists).
    report["request_creation"] = importlib.import_module("bench.request_bench").run(quick)
    status = 0
    if not args.no_tensor:
        try:
            report["tensor"] = _tensor(quick)
        except Exception as error:  # report the failure, keep the manager results
            print(f"\ntensor bench FAILED: {type(error).__name__}: {error}")
            report["tensor"] = {"error": f"{type(error).__name__}: {error}"}
            status = 1

    if args.vllm:
        targets = importlib.import_module("bench.vllm_targets")
        python = vllm_python()
        report["vllm_targets"] = [list(row) for row in targets.run(python, quick=quick)]
    report["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"bench-{stamp}.json"
    text = json.dumps(report, indent=2, default=str)
    path.write_text(text)
    (args.out / "latest.json").write_text(text)
    print(f"\nresults: {path} (also {args.out / 'latest.json'}); wall time {report['wall_s']:.0f} s")
    print(f"reproduce: {command}")
    return status


if __name__ == "__main__":
    sys.exit(main())
