"""`make verify-abuse`: vLLM's OpenAI server on pagedkv under abuse loses nothing and leaks nothing.

Runs in the engine venv (tools/verify_engine/install.sh). The same seeded workload (plan.py:
bad requests, disconnects before the first token, mid-prefill and mid-decode, aborts of waiting
and preempted requests, n > 1, best_of, stop strings, duplicate request ids, prefix-cache resets
while requests run, a burst of 4x the pool) goes through `vllm serve` three times, each on a fresh
server with a small pool:
1. stock vLLM, first a clean run of every compared request (the reference outputs), then the abuse;
2. pagedkv (`pagedkv.vllm.Scheduler` with a probe), the abuse;
3. the negative control: pagedkv that leaks one block on an abort; the check must fail on it.
Each run is judged alone (verdict.py) and pagedkv against stock; the summary table prints both.
`--soak` runs soak.py instead. Exit status 0 only if both engines pass, agree, and the control fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine_run  # noqa: E402
import plan as pl  # noqa: E402
import server as sv  # noqa: E402
import verdict as vd  # noqa: E402

REPO = HERE.parent.parent


def log(msg: str) -> None:
    print(f"[verify-abuse {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=os.environ.get("PAGEDKV_ENGINE_CACHE", str(Path.home() / ".cache/pagedkv")))
    ap.add_argument("--results", default=str(REPO / ".abuse-results"), help="folder for the JSON results and plots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="llama", choices=["llama", "hybrid"],
                    help="verify-engine's tiny Llama, or its Gemma-3 (sliding window + full attention)")
    ap.add_argument("--load", type=int, default=pl.Sizes.load, help="streams in the load phase")
    ap.add_argument("--concurrency", type=int, default=pl.Sizes.concurrency)
    ap.add_argument("--burst-factor", type=int, default=pl.Sizes.burst_factor)
    ap.add_argument("--control-load", type=int, default=16, help="streams in the negative control's load phase")
    ap.add_argument("--skip-control", action="store_true")
    ap.add_argument("--seeded-sampling", action="store_true",
                    help="add seeded n=2 requests (vLLM 0.32 CPU crashes on them, stock as pagedkv)")
    ap.add_argument("--candidate", default="pagedkv", choices=["pagedkv", "stock"],
                    help="the engine checked against stock (stock: the workload's self-check)")
    ap.add_argument("--soak", action="store_true", help="run the soak (soak.py) instead")
    ap.add_argument("--soak-requests", type=int, default=600)
    ap.add_argument("--soak-variant", default="pagedkv", choices=["pagedkv", "stock"])
    args = ap.parse_args()

    import models

    cache = Path(args.cache_dir)
    work = cache / "abuse-runs"
    work.mkdir(parents=True, exist_ok=True)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    model_dir = str(models.write_model(args.model, cache / "models"))
    shape = sv.ServerShape()
    sizes = pl.Sizes(load=args.load, concurrency=args.concurrency, burst_factor=args.burst_factor,
                     seeded=args.seeded_sampling)

    if args.soak:
        import soak

        return soak.main(sv.VARIANTS[args.soak_variant], args.soak_variant, model_dir, shape, sizes,
                         args.seed, args.soak_requests, work, results, log)

    workload = pl.build(args.seed, sizes, shape.max_model_len, shape.block_size, shape.usable_tokens)
    calls = {c.name: c for phase in workload.phases.values() for c in phase}
    calls.update({c.name: c for c in pl.after_calls(engine_run.aborted_calls(workload))})
    log(f"workload seed {args.seed}: " + ", ".join(f"{k} {len(v)}" for k, v in workload.phases.items())
        + f"; pool {shape.num_blocks} blocks of {shape.block_size}, max_model_len {shape.max_model_len}, "
        f"max_num_seqs {shape.max_num_seqs}, chunks of {shape.max_num_batched_tokens} tokens")

    runs: dict[str, dict[str, Any]] = {}
    for variant in ("stock", args.candidate):
        tag = variant if variant not in runs else f"{variant}-again"
        log(f"{tag}: --scheduler-cls {sv.VARIANTS[variant]}")
        runs[tag] = engine_run.run(sv.VARIANTS[variant], tag, model_dir, shape, workload, sizes, work,
                                   clean_first=not runs, log=log)
    clean = {o["name"]: o for o in runs["stock"].get("clean", [])}
    verdicts = {tag: vd.judge(run, calls, clean) for tag, run in runs.items()}
    failures: list[str] = []
    for tag, v in verdicts.items():
        failures += [f"{tag}: {f}" for f in v["failures"]]
    cand_tag = list(runs)[1]
    diffs = vd.compare(runs["stock"], runs[cand_tag], verdicts["stock"], verdicts[cand_tag])
    failures += [f"{cand_tag} vs stock: {d}" for d in diffs]
    if sum(verdicts["stock"]["aborted_in_engine"].values()) == 0:
        failures.append("stock: the scheduler saw no abort: the workload tests nothing")

    control: dict[str, Any] = {}
    if args.candidate == "stock" and not args.skip_control:
        log("negative control: skipped (its leaking scheduler is pagedkv's; run with --candidate pagedkv)")
    elif not args.skip_control:
        variant = "pagedkv-leaky"
        log(f"negative control: {variant}, load phase of {args.control_load} streams")
        small = dataclasses.replace(sizes, load=args.control_load)
        control_workload = pl.build(args.seed, small, shape.max_model_len, shape.block_size, shape.usable_tokens)
        control_calls = {c.name: c for phase in control_workload.phases.values() for c in phase}
        control_calls.update({c.name: c for c in pl.after_calls(engine_run.aborted_calls(control_workload, ("load",)))})
        run = engine_run.run(sv.VARIANTS[variant], "control", model_dir, shape, control_workload, small,
                             work, clean_first=False, log=log, phases=("load",))
        runs["control"] = run
        v = vd.judge(run, control_calls, clean)
        verdicts[f"control ({variant})"] = v
        # Caught by the leak check itself (after the drain or at the end), not by chance.
        caught = max(v["leaked_blocks"] or 0, v["leaked_blocks_end"] or 0) > 0
        control = {"variant": variant, "caught": caught, "failures": v["failures"][:5]}
        log(f"  control {'CAUGHT' if caught else 'NOT CAUGHT'}: " + "; ".join(v["failures"][:3]))
        if not caught:
            failures.append(f"negative control {variant} was not caught: the check has no teeth")

    print()
    print(vd.table(verdicts))
    print()
    report = results / f"abuse-{args.model}-seed{args.seed}.json"
    report.write_text(json.dumps({"verdicts": verdicts, "control": control, "runs": runs,
                                  "failures": failures}, indent=1, default=str))
    log(f"results: {report}")
    if failures:
        log("FAILED:\n  " + "\n  ".join(failures[:40]))
        return 1
    log(f"OK: stock and {cand_tag} agree on every call, 0 differing outputs, 0 leaked blocks, 0 5xx"
        + (", negative control caught" if control else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
