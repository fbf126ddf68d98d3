"""Optional: the standard chat trace through vLLM's own KVCacheManager and
through pagedkv's optimized manager, in one run, and the ratio.

    .venv/bin/python -m bench.vllm_side_by_side --vllm-python ../vllm-venv/bin/python

vLLM runs in *its* interpreter (a separate virtual environment, outside this
checkout: ../shared/anchors.md shows how to install vLLM 0.33 on CPU), as a
subprocess that loads ``src/pagedkv/trace.py`` by path -- the same steps, the
same timers (``perf_counter_ns`` around each manager call). No vLLM code is
copied here; vLLM is only called. ``make bench`` never needs vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import manager_bench as mb
from pagedkv.trace import STANDARD, TraceConfig

TRACE_PY = Path(__file__).resolve().parent.parent / "src" / "pagedkv" / "trace.py"

# Runs inside vLLM's interpreter: argv = [trace.py path, num_requests, num_blocks].
_CHILD = r'''
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("pagedkv_trace", sys.argv[1])
trace = importlib.util.module_from_spec(spec)
sys.modules["pagedkv_trace"] = trace
spec.loader.exec_module(trace)
num_requests, num_blocks = int(sys.argv[2]), int(sys.argv[3])

import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

config = trace.TraceConfig(num_requests=num_requests)
bs = config.block_size
init_none_hash(sha256)
hasher = get_request_block_hasher(bs, sha256)
kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
        block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16))])
manager = KVCacheManager(kv_config, 8192, scheduler_block_size=bs, hash_block_size=bs)
steps = list(trace.standard_trace(config))
clock = time.perf_counter_ns
ns = dict.fromkeys(trace.CALL_KINDS, 0)
calls = dict.fromkeys(trace.CALL_KINDS, 0)
requests, hits, prompt_tokens = {}, {}, 0
for step in steps:
    kind = type(step).__name__
    if kind == "AllocateSlots":
        request = requests[step.request_id]
        if step.uses_prefix_hit:
            blocks = hits.pop(step.request_id)
            t = clock()
            out = manager.allocate_slots(request, step.num_new_tokens, step.num_new_computed_tokens, blocks)
            ns["allocate_slots"] += clock() - t
        else:
            t = clock()
            out = manager.allocate_slots(request, step.num_new_tokens)
            ns["allocate_slots"] += clock() - t
        calls["allocate_slots"] += 1
        if out is None:
            raise SystemExit(f"vLLM refused {step}")
        request.num_computed_tokens += step.num_new_computed_tokens + step.num_new_tokens
    elif kind == "AppendToken":
        request = requests[step.request_id]
        t = clock()
        request.append_output_token_ids(step.token_id)
        ns["append_token"] += clock() - t
        calls["append_token"] += 1
    elif kind == "GetComputedBlocks":
        request = requests[step.request_id]
        t = clock()
        blocks, hit = manager.get_computed_blocks(request)[:2]
        ns["get_computed_blocks"] += clock() - t
        calls["get_computed_blocks"] += 1
        if hit != step.expected_hit_tokens:
            raise SystemExit(f"vLLM hit {hit} tokens at {step}")
        hits[step.request_id] = blocks
    elif kind == "AddRequest":
        prompt = list(step.prompt_token_ids)
        params = SamplingParams(max_tokens=config.decode_steps + 1)
        t = clock()
        request = Request(step.request_id, prompt, sampling_params=params, pooling_params=None,
                          block_hasher=hasher)
        ns["make_request"] += clock() - t
        calls["make_request"] += 1
        prompt_tokens += len(prompt)
        requests[step.request_id] = request
    elif kind == "Free":
        request = requests.pop(step.request_id)
        t = clock()
        manager.free(request)
        ns["free"] += clock() - t
        calls["free"] += 1
print(json.dumps({"vllm_version": vllm.__version__, "python": sys.version.split()[0],
                  "time_ns": ns, "calls": calls, "prompt_tokens": prompt_tokens}))
'''


def run_vllm(vllm_python: str, config: TraceConfig, num_blocks: int = 8192) -> dict[str, Any]:
    """One replay of the trace through vLLM's manager in ``vllm_python``; per-kind
    ``us_per_call``, ``manager_total_ms``, ``request_creation_us_per_token``."""
    done = subprocess.run(
        [vllm_python, "-c", _CHILD, str(TRACE_PY), str(config.num_requests), str(num_blocks)],
        capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    raw: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    ns, calls = raw["time_ns"], raw["calls"]
    return {
        "vllm_version": raw["vllm_version"], "python": raw["python"],
        "manager_total_ms": sum(ns[k] for k in ("get_computed_blocks", "allocate_slots", "free")) / 1e6,
        "us_per_call": {k: ns[k] / calls[k] / 1000 if calls[k] else 0.0 for k in ns},
        "request_creation_us_per_token": ns["make_request"] / 1000 / raw["prompt_tokens"],
        "calls": calls,
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    return {**first,
            "manager_total_ms": statistics.median(r["manager_total_ms"] for r in runs),
            "request_creation_us_per_token": statistics.median(
                r["request_creation_us_per_token"] for r in runs),
            "us_per_call": {k: statistics.median(r["us_per_call"][k] for r in runs)
                            for k in first["us_per_call"]}}


def main(argv: Sequence[str] | None = None) -> int:
    """Run both managers once on the trace (hash sha256) and print the ratios."""
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_side_by_side", description=__doc__)
    parser.add_argument("--vllm-python", required=True, metavar="PATH",
                        help="the python of a virtual environment with vLLM installed")
    parser.add_argument("--requests", type=int, default=STANDARD.num_requests, metavar="N")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="runs of each manager, alternating; medians (default 1)")
    args = parser.parse_args(argv)
    config = TraceConfig(num_requests=args.requests)
    vllm_runs, our_runs = [], []
    for _ in range(max(1, args.runs)):  # alternate, so drift on the machine hits both
        vllm_runs.append(run_vllm(args.vllm_python, config))
        our_runs.append(mb.run_trace("optimized", "sha256", 1, config))
    theirs, ours = _median(vllm_runs), _median(our_runs)
    rows = [("manager total (ms)", theirs["manager_total_ms"], ours["manager_total_ms"])]
    for kind in ("allocate_slots", "get_computed_blocks", "free"):
        rows.append((f"{kind} (µs/call)", theirs["us_per_call"][kind], ours["us_per_call"][kind]))
    rows.append(("request creation sha256 (µs/token)", theirs["request_creation_us_per_token"],
                 ours["request_creation_us_per_token"]))
    rows.append(("append_token (µs/call)", theirs["us_per_call"]["append_token"],
                 ours["us_per_call"]["append_token"]))
    print(f"standard chat trace, {config.num_requests} requests, 8192 blocks, sha256, "
          f"median of {max(1, args.runs)} run(s) each; "
          f"vLLM {theirs['vllm_version']} (Python {theirs['python']}) vs pagedkv optimized")
    print(f"| {'figure':<36} | {'vLLM':>10} | {'pagedkv':>10} | {'vLLM/pagedkv':>12} |")
    print(f"|{'-' * 38}|{'-' * 12}|{'-' * 12}|{'-' * 14}|")
    for label, vllm_value, our_value in rows:
        ratio = vllm_value / our_value if our_value else float("nan")
        print(f"| {label:<36} | {vllm_value:>10.3f} | {our_value:>10.3f} | {ratio:>11.1f}× |")
    print("reproduce: .venv/bin/python -m bench.vllm_side_by_side "
          f"--vllm-python {args.vllm_python} --runs {max(1, args.runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
