"""The engine bench's manager calls without the model: vLLM's scheduler, stock vs pagedkv.

Drives vLLM's own ``Scheduler`` (the class the engine runs, with the engine check's timing
proxies from tools/verify_engine/engine_schedulers.py) through the engine check's mixed workload
(240 requests, block size 32, 32 sequences, 512 batched tokens), feeding it a fixed sampled token
per decode instead of running a model. The manager sees the same call pattern as in
``make verify-engine``'s bench, in seconds instead of minutes: a quick A/B while working on the
adapter (src/pagedkv/vllm/). The figure that counts is the engine's (``make verify-engine``).

Run in a venv with vLLM and its test tree (the overlay of tools/verify_vllm.py):
  PYTHONPATH=tools/verify_engine:$HOME/.cache/pagedkv/vllm-0.33.0 \
      .vllm-overlay/bin/python tools/adapter_bench.py [--rounds 5] [--profile pagedkv] [--tree DIR]

``--tree DIR`` imports pagedkv from another checkout (as tools/engine_bench.py does), e.g. a
clone at an older commit for a before/after pair.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

import engine_schedulers as es
import workloads as wl
from vllm.v1.outputs import ModelRunnerOutput

from tests.v1.core.utils import create_requests, create_scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import SAMPLES, TRIM_S, point_pagedkv_at, sample_calls  # noqa: E402


def make_requests(w: wl.Workload) -> list[Any]:
    prompts = [p for b in w.batches for p in b.prompts]
    max_tokens = [m for b in w.batches for m in b.max_tokens]
    reqs = create_requests(len(prompts), num_tokens=1, block_size=wl.BLOCK_SIZE, ignore_eos=True)
    made = []
    for i, (req, prompt, m) in enumerate(zip(reqs, prompts, max_tokens)):
        # The helper's prompt is a placeholder: rebuild each request with its own prompt.
        req.sampling_params.max_tokens = m
        made.append(type(req)(request_id=f"r{i}", prompt_token_ids=prompt,
                              sampling_params=req.sampling_params, pooling_params=None,
                              block_hasher=req._block_hasher))
    return made


def run(cls: type, w: wl.Workload, num_blocks: int) -> int:
    sched = create_scheduler(enable_prefix_caching=True, block_size=wl.BLOCK_SIZE,
                             max_num_seqs=w.max_num_seqs, max_num_batched_tokens=512,
                             num_blocks=num_blocks, max_model_len=w.max_model_len,
                             scheduler_cls=cls)
    for req in make_requests(w):
        sched.add_request(req)
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            sampled.append([] if req.num_computed_tokens < req.num_tokens else [3 + req.num_tokens % 1000])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=[])
        sched.update_from_output(out, mro)
        steps += 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-blocks", type=int, default=4000)
    ap.add_argument("--profile", default="", help="variant to run once under cProfile")
    ap.add_argument("--tree", type=Path, default=None, help="import pagedkv from this checkout")
    args = ap.parse_args()
    if args.tree is not None:
        point_pagedkv_at(args.tree.resolve())  # before the pagedkv variant imports it
    w = wl.mixed("llama", 4)
    sample_calls()
    variants = {"stock": es.StockTimed, "pagedkv": es.PagedkvTimed}
    if args.profile:
        cls = variants[args.profile]
        run(cls, w, args.num_blocks)
        prof = cProfile.Profile()
        prof.enable()
        run(cls, w, args.num_blocks)
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats("pagedkv", 60)
        return
    per_step: dict[str, list[float]] = {v: [] for v in variants}
    per_call: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    total_steps: dict[str, int] = {v: 0 for v in variants}
    for cls in variants.values():  # warm-up
        run(cls, w, args.num_blocks)
        es.take_timing(cls.LABEL)
    SAMPLES.clear()  # the statistic below counts the timed rounds only
    for i in range(args.rounds):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for v in order:
            cls = variants[v]
            run(cls, w, args.num_blocks)
            t = es.take_timing(cls.LABEL)
            per_step[v].append(1e6 * t["kv_seconds"] / t["steps"])
            total_steps[v] += t["steps"]
            for name, n in t["calls"].items():
                per_call[v].setdefault(name, []).append(1e6 * t["method_seconds"][name] / n)
    s, p = statistics.median(per_step["stock"]), statistics.median(per_step["pagedkv"])
    print(f"KV-manager µs per step (median of {args.rounds} rounds' sums): stock {s:.1f}, pagedkv {p:.1f}, "
          f"ratio {s / p:.2f}x")
    # Calls over 1 ms left out (tools/engine_bench.py's statistic), over every round and step.
    robust = {}
    for v, cls in variants.items():
        kept = sum(x for calls in SAMPLES[cls.LABEL].values() for x in calls if x <= TRIM_S)
        robust[v] = 1e6 * kept / total_steps[v]
    print(f"calls over 1 ms left out: stock {robust['stock']:.1f}, pagedkv {robust['pagedkv']:.1f}, "
          f"ratio {robust['stock'] / robust['pagedkv']:.2f}x")
    print("µs per call: median of rounds' means; median and mean without calls over 1 ms, over "
          "every timed call (stock / pagedkv):")
    for name in sorted(per_call["stock"]):
        a = statistics.median(per_call["stock"][name])
        b = statistics.median(per_call["pagedkv"].get(name, [0.0]))
        robust_calls = []
        for cls in variants.values():
            calls = SAMPLES[cls.LABEL].get(name) or [0.0]
            kept = [x for x in calls if x <= TRIM_S] or [0.0]
            robust_calls.append((1e6 * statistics.median(calls), 1e6 * sum(kept) / len(kept)))
        (sa, sb), (pa, pb) = robust_calls
        print(f"  {name:32s} {a:7.2f} {b:7.2f}   {sa:7.2f} {sb:7.2f}   {pa:7.2f} {pb:7.2f}")


if __name__ == "__main__":
    main()
