"""One engine process of the check: runs workloads on one scheduler variant, writes JSON.

Run by engine_check.py in the engine venv, never imported by pagedkv. Modes:
  worker.py run   --variant V --model-dir D --workloads W1,W2 --out F
  worker.py bench --variants stock,pagedkv --model-dir D --workload W --rounds R --out F
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl  # noqa: E402

COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions")


# The engine's KV event stream (`--kv-events`): vLLM's own ZMQ publisher, bound to ipc sockets
# (local only), read back through its replay socket after each workload, so nothing is lost to
# a slow subscriber. Set by main() before the engine is built.
KV_EVENTS: dict[str, str] = {}


def kv_events_config() -> Any:
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=KV_EVENTS["endpoint"],
                          replay_endpoint=KV_EVENTS["replay"], topic="kv")


def event_batches(start: int) -> list[dict[str, Any]]:
    """The published batches from sequence ``start`` on, decoded to plain maps, without their
    timestamps (the only field two runs of the same requests may not share)."""
    from pagedkv.events import ZmqEventSubscriber

    subscriber = ZmqEventSubscriber(KV_EVENTS["endpoint"], KV_EVENTS["replay"], topic="kv")
    try:
        time.sleep(0.2)  # vLLM's publisher thread drains its queue asynchronously
        batches = subscriber.replay(start, timeout_ms=10_000)
    finally:
        subscriber.close()
    return [{"seq": b.seq, "events": b.events, "rank": b.data_parallel_rank} for b in batches]


def make_llm(variant: str, model_dir: str, w: wl.Workload) -> Any:
    from engine_schedulers import VARIANTS
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=model_dir,
        tokenizer=model_dir,
        scheduler_cls=VARIANTS[variant],
        block_size=wl.BLOCK_SIZE,
        max_model_len=w.max_model_len,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        load_format="auto",
        dtype="float32",
        seed=0,
        disable_log_stats=False,
        enforce_eager=True,
    )
    if w.num_blocks is not None:
        kwargs["num_gpu_blocks_override"] = w.num_blocks
    if KV_EVENTS:
        kwargs["kv_events_config"] = kv_events_config()
    if w.retention is not None and variant.startswith("pagedkv"):
        # How a vLLM user turns retention on (docs/retention.md); stock vLLM never sees it.
        kwargs["additional_config"] = {"pagedkv_retention": w.retention}
    return LLM(**kwargs)


def counters(llm: Any) -> dict[str, float]:
    found = {name: 0.0 for name in COUNTERS}
    for metric in llm.get_metrics():
        if metric.name in found:
            found[metric.name] += float(getattr(metric, "value", 0.0))
    return found


def run_batches(llm: Any, w: wl.Workload) -> tuple[list[dict[str, Any]], float, int]:
    from vllm import SamplingParams

    outputs: list[dict[str, Any]] = []
    seconds = 0.0
    out_tokens = 0
    for batch in w.batches:
        extra = batch.extra_args or [None] * len(batch.prompts)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, extra_args=x)
                  for m, x in zip(batch.max_tokens, extra)]
        prompts = [{"prompt_token_ids": p} for p in batch.prompts]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds += time.perf_counter() - t0
        for r in results:
            tokens = list(r.outputs[0].token_ids)
            out_tokens += len(tokens)
            outputs.append({"tokens": tokens, "cached": int(r.num_cached_tokens or 0)})
    return outputs, seconds, out_tokens


def run_workload(llm: Any, label: str, w: wl.Workload) -> dict[str, Any]:
    from engine_schedulers import take_timing

    llm.reset_prefix_cache()
    published = event_batches(0) if KV_EVENTS else []
    first = published[-1]["seq"] + 1 if published else 0
    before = counters(llm)
    take_timing(label)
    outputs, seconds, out_tokens = run_batches(llm, w)
    timing = take_timing(label)
    after = counters(llm)
    events = event_batches(first) if KV_EVENTS else None
    return {
        "kv_events": events,
        "workload": w.name,
        "outputs": outputs,
        "counters": {k: after[k] - before[k] for k in COUNTERS},
        "seconds": seconds,
        "requests": len(outputs),
        "output_tokens": out_tokens,
        "timing": timing,
    }


def label_of(variant: str) -> str:
    import engine_schedulers
    from engine_schedulers import VARIANTS

    cls_name = VARIANTS[variant].rsplit(".", 1)[1]
    return str(getattr(engine_schedulers, cls_name).LABEL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "bench"])
    ap.add_argument("--variant", default="stock")
    ap.add_argument("--variants", default="stock,pagedkv")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--workloads", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-events", action="store_true",
                    help="run mode: publish KV events (vLLM's ZMQ publisher) and record the stream")
    args = ap.parse_args()
    if args.kv_events:
        base = f"ipc://{Path(args.out).with_suffix('')}"
        KV_EVENTS.update(endpoint=f"{base}.kv-events", replay=f"{base}.kv-replay")
    by_name = {w.name: w for w in wl.all_workloads()}
    names = [n for n in args.workloads.split(";") if n]
    chosen = [by_name[n] for n in names]
    result: dict[str, Any]
    if args.mode == "run":
        llm = make_llm(args.variant, args.model_dir, chosen[0])
        label = label_of(args.variant)
        result = {"variant": args.variant, "runs": [run_workload(llm, label, w) for w in chosen]}
    else:
        # Two engines in one process, alternating rounds (ABBA...), so drift hits both alike.
        variants = args.variants.split(",")
        w = chosen[0]
        engines = {v: make_llm(v, args.model_dir, w) for v in variants}
        rounds: list[dict[str, Any]] = []
        run_workload(engines[variants[0]], label_of(variants[0]), w)  # warm-up, both
        run_workload(engines[variants[1]], label_of(variants[1]), w)
        for i in range(args.rounds):
            order = variants if i % 2 == 0 else variants[::-1]
            for v in order:
                r = run_workload(engines[v], label_of(v), w)
                r.pop("outputs")
                r["variant"] = v
                r["round"] = i
                rounds.append(r)
        result = {"bench": rounds}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
