"""Optional: pagedkv's optimized manager beside vLLM 0.33's own KVCacheManager,
in one invocation, sides alternating, medians, per-call ratios.

Three workloads (hash ``sha256`` on both sides, or ``--hash fast``: pagedkv's
``xxh3_128`` against vLLM's ``xxhash``):

- the standard chat trace (``src/pagedkv/trace.py``) on ``--model llama3``,
  ``gemma3`` (5 sliding-window groups w1024 : 1 full) or ``jamba`` (full
  attention + Mamba in mode ``align``, the only Mamba mode vLLM 0.33 caches);
- ``--prompt-lengths 1k,8k,32k,128k``: one full-attention group, block 16,
  prompts of L tokens (half shared, half unique), one request at a time
  (create, look up, allocate the rest, free); ns per block;
- ``--trace PATH --block-size N``: a Mooncake JSONL trace, one request at a
  time, a pool that never evicts (hash id h = 512 deterministic token ids
  made from h, ``bench/side_driver.py``).

Hit tokens are compared request by request; a difference fails the run.

    .venv/bin/python -m bench.vllm_side_by_side --model jamba --runs 3
    .venv/bin/python -m bench.vllm_side_by_side --prompt-lengths 1k,8k,32k,128k
    .venv/bin/python -m bench.vllm_side_by_side --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --block-size 512

vLLM runs in *its* interpreter (``--vllm-python``, default ``$VLLM_PYTHON`` or
the venv ``make vllm-venv`` builds, ``bench/locations.py``) as a subprocess
running ``bench/vllm_child.py``, which loads ``src/pagedkv/trace.py`` and
``bench/side_driver.py`` by path: the same steps, token lists and timers. No
vLLM code is copied; vLLM is only called. ``make bench`` never needs vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import side_driver as sd
from bench.locations import vllm_python
from pagedkv.optimized.native import build_name
from pagedkv.trace import DEFAULT_NUM_BLOCKS, STANDARD, TraceConfig, TraceDriver, standard_trace

ROOT = Path(__file__).resolve().parent.parent
TRACE_PY = ROOT / "src" / "pagedkv" / "trace.py"
DRIVER_PY = ROOT / "bench" / "side_driver.py"
CHILD_PY = ROOT / "bench" / "vllm_child.py"
DEFAULT_VLLM_PYTHON = vllm_python()
"""vLLM's interpreter unless ``--vllm-python`` names another (``bench/locations.py``)."""
HASHES = {"sha256": ("sha256", "sha256"), "fast": ("xxh3_128", "xxhash")}
"""``--hash`` -> (pagedkv's name, vLLM's name)."""
KINDS = ("get_computed_blocks", "allocate_slots", "free")


def kv_cache_config(model: str, num_blocks: int, block_size: int) -> Any:
    """pagedkv's KV cache of ``model``; ``jamba`` with Mamba in mode ``align``."""
    from pagedkv.spec.mamba_spec import MambaSpec
    from pagedkv.trace import standard_kv_cache_config

    config = standard_kv_cache_config(num_blocks, block_size, model)
    if model != "jamba":
        return config
    groups = tuple(dataclasses.replace(g, kv_cache_spec=dataclasses.replace(
        g.kv_cache_spec, mamba_cache_mode="align")) if isinstance(g.kv_cache_spec, MambaSpec) else g
        for g in config.kv_cache_groups)
    return dataclasses.replace(config, kv_cache_groups=groups)


def pagedkv_manager(model: str, num_blocks: int, block_size: int, max_model_len: int,
                    hash_fn: str) -> Any:
    """An optimized ``KVCacheManager`` for ``model``."""
    from pagedkv.optimized import KVCacheManager

    return KVCacheManager(kv_cache_config(model, num_blocks, block_size), max_model_len, hash_fn=hash_fn)


def run_vllm(vllm_python: str, job: dict[str, Any]) -> dict[str, Any]:
    """One replay in vLLM's interpreter (``bench/vllm_child.py``); its raw JSON."""
    job = {**job, "trace_py": str(TRACE_PY), "driver_py": str(DRIVER_PY)}
    done = subprocess.run([vllm_python, str(CHILD_PY), json.dumps(job)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    raw: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return raw


def _trace_figures(ns: dict[str, int], calls: dict[str, int], prompt_tokens: int) -> dict[str, float]:
    out = {k: ns[k] / calls[k] / 1000 if calls[k] else 0.0 for k in ns}
    out["manager_ms"] = sum(ns[k] for k in KINDS) / 1e6
    out["creation_per_token"] = ns["make_request"] / 1000 / prompt_tokens
    return out


def _our_trace(model: str, hash_fn: str, config: TraceConfig) -> tuple[dict[str, float], list[int]]:
    manager = pagedkv_manager(model, DEFAULT_NUM_BLOCKS[model], config.block_size, 8192, hash_fn)
    driver = TraceDriver(manager)
    hits: list[int] = []
    gc.collect()
    for step in standard_trace(config):
        result = driver.apply(step)
        if type(step).__name__ == "GetComputedBlocks":
            assert isinstance(result, tuple)
            hits.append(int(result[1]))
    return _trace_figures(driver.time_ns, driver.calls, driver.prompt_tokens_hashed), hits


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _check_hits(theirs: list[int], ours: list[int], what: str) -> None:
    if theirs != ours:
        first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise SystemExit(f"{what}: hit tokens differ first at request {first}: vLLM "
                         f"{theirs[first:first + 1]}, pagedkv {ours[first:first + 1]}")


def _row(label: str, theirs: float, ours: float, digits: int = 3) -> str:
    ratio = theirs / ours if ours else float("nan")
    return f"| {label} | {theirs:.{digits}f} | {ours:.{digits}f} | {ratio:.2f}× |"


Figures = dict[str, dict[str, float]]
"""``{"vllm": {figure: value}, "pagedkv": {figure: value}}``: one workload's medians."""


def standard_side_by_side(vllm_python: str, model: str, hash_name: str, runs: int, requests: int) -> Figures:
    """The standard chat trace on ``model``; prints the table, returns the medians
    (µs per call by call kind, ``manager_ms``, ``creation_per_token`` in µs)."""
    ours_hash, vllm_hash = HASHES[hash_name]
    config = TraceConfig(num_requests=requests)
    job = {"kind": "trace", "model": model, "block_size": config.block_size, "hash": vllm_hash,
           "num_blocks": DEFAULT_NUM_BLOCKS[model], "max_model_len": 8192, "requests": requests,
           "max_tokens": config.decode_steps + 1}
    theirs_runs, ours_runs, version = [], [], ""
    for _ in range(runs):  # alternate, so drift on the machine hits both
        raw = run_vllm(vllm_python, job)
        version = f"vLLM {raw['vllm_version']} (Python {raw['python']})"
        theirs_runs.append(_trace_figures(raw["time_ns"], raw["calls"], raw["prompt_tokens"]))
        ours, hits = _our_trace(model, ours_hash, config)
        ours_runs.append(ours)
        _check_hits(raw["hits"], hits, f"standard trace on {model}")
    theirs, ours = _median(theirs_runs), _median(ours_runs)
    print(f"\n### Standard chat trace, {model}{' (Mamba align)' if model == 'jamba' else ''}, "
          f"{requests} requests, {job['num_blocks']} blocks, hash {hash_name}; median of {runs} "
          f"alternating run(s); {version} vs pagedkv optimized ({build_name()} loops); hit tokens identical "
          f"({sum(hits)} in all)")
    print("| figure | vLLM | pagedkv | vLLM/pagedkv |\n|---|---|---|---|")
    for kind in KINDS:
        print(_row(f"{kind} (µs/call)", theirs[kind], ours[kind], 2))
    print(_row("manager total (ms)", theirs["manager_ms"], ours["manager_ms"], 1))
    print(_row("request creation (µs/token)", theirs["creation_per_token"], ours["creation_per_token"]))
    print(_row("append_token (µs/call)", theirs["append_token"], ours["append_token"]))
    return {"vllm": theirs, "pagedkv": ours}


def _our_prompts(prompts: Any, block_size: int, num_blocks: int, max_model_len: int, hash_fn: str,
                 skip_first: int) -> dict[str, Any]:
    manager = pagedkv_manager("llama3", num_blocks, block_size, max_model_len, hash_fn)
    gc.collect()
    return sd.replay_one_at_a_time(prompts, block_size, manager.make_request, manager.get_computed_blocks,
                                   manager.allocate_slots, manager.free, skip_first)


def _alternate(vllm_python: str, job: dict[str, Any], make_prompts: Any, runs: int, what: str
               ) -> tuple[dict[str, float], dict[str, float], dict[str, Any]]:
    ours_hash = job.pop("ours_hash")
    theirs_runs, ours_runs = [], []
    raw_ours: dict[str, Any] = {}
    for _ in range(runs):
        raw_theirs = run_vllm(vllm_python, job)
        raw_ours = _our_prompts(make_prompts(), job["block_size"], job["num_blocks"], job["max_model_len"],
                                ours_hash, job.get("skip_first", 0))
        _check_hits(raw_theirs["hits"], raw_ours["hits"], what)
        theirs_runs.append(sd.summarize(raw_theirs))
        ours_runs.append(sd.summarize(raw_ours))
    return _median(theirs_runs), _median(ours_runs), {**raw_ours, "vllm": raw_theirs["vllm_version"]}


def long_prompts_side_by_side(vllm_python: str, lengths: Sequence[int], hash_name: str, runs: int,
                              repeats: int) -> dict[int, Figures]:
    """Long prompts (one full group, block 16); prints ns per block per length,
    returns each length's medians (``side_driver.summarize``'s figures)."""
    ours_hash, vllm_hash = HASHES[hash_name]
    block_size = 16
    rows: list[str] = []
    figures: dict[int, Figures] = {}
    flat: dict[str, list[float]] = {k: [] for k in ("make_request", *KINDS)}
    for length in lengths:
        num_blocks = (repeats + 1) * (-(-length // block_size)) + 2
        job = {"kind": "prompts", "model": "llama3", "block_size": block_size, "hash": vllm_hash,
               "num_blocks": num_blocks, "max_model_len": length + block_size, "prompt_tokens": length,
               "repeats": repeats, "skip_first": 1, "ours_hash": ours_hash}
        theirs, ours, raw = _alternate(vllm_python, job, lambda n=length: sd.long_prompts(n, repeats), runs,
                                       f"long prompts of {length} tokens")
        figures[length] = {"vllm": theirs, "pagedkv": ours}
        cells = [f"{length // 1024}k", str(raw["hits"][-1])]
        for kind in ("make_request", *KINDS):
            flat[kind].append(ours[kind])
            cells.append(f"{theirs[kind]:.0f} / {ours[kind]:.0f} = **{theirs[kind] / ours[kind]:.2f}×**")
        rows.append("| " + " | ".join(cells) + " |")
    print(f"\n### Long prompts: one full-attention group, block 16, hash {hash_name}; {repeats} timed "
          f"requests per length after a warm-up, half shared; median of {runs} alternating run(s); "
          f"vLLM {raw['vllm']} vs pagedkv optimized ({build_name()} loops); cells: vLLM / pagedkv ns per unit = ratio")
    print("| L | hit tokens (both) | creation (ns/token) | get_computed_blocks (ns/hit block) | "
          "allocate_slots (ns/new block) | free (ns/block) |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    if len(lengths) > 1:
        print("pagedkv per-block cost, longest / shortest L: " + ", ".join(
            f"{k} {v[-1] / v[0]:.2f}" for k, v in flat.items()))
    return figures


def mooncake_side_by_side(vllm_python: str, path: str, block_size: int, limit: int | None, hash_name: str,
                          runs: int) -> Figures:
    """A Mooncake trace one request at a time, pool never evicting; prints totals,
    returns the medians (``side_driver.summarize``'s figures)."""
    ours_hash, vllm_hash = HASHES[hash_name]
    requests = sd.mooncake_requests(path, limit)
    num_blocks = sum(-(-n // block_size) for n, _ in requests) + 2
    max_len = max(n for n, _ in requests) + block_size
    job = {"kind": "prompts", "model": "llama3", "block_size": block_size, "hash": vllm_hash,
           "num_blocks": num_blocks, "max_model_len": max_len, "mooncake": path, "limit": limit,
           "ours_hash": ours_hash}
    theirs, ours, raw = _alternate(vllm_python, job, lambda: sd.mooncake_prompts(requests), runs,
                                   f"Mooncake trace {path}")
    print(f"\n### Mooncake trace {Path(path).name}: {len(requests)} requests, block {block_size}, one at a "
          f"time, {num_blocks} blocks (never evicts), hash {hash_name}; median of {runs} alternating "
          f"run(s); vLLM {raw['vllm']} vs pagedkv optimized ({build_name()} loops); per-request hit tokens identical "
          f"({sum(raw['hits'])} of {raw['tokens']} tokens)")
    print("| figure | vLLM | pagedkv | vLLM/pagedkv |\n|---|---|---|---|")
    print(_row("manager total (ms)", theirs["manager_ms"], ours["manager_ms"], 1))
    print(_row("manager + request creation (ms)", theirs["manager_and_creation_ms"],
               ours["manager_and_creation_ms"], 1))
    print(_row("request creation (ns/token)", theirs["make_request"], ours["make_request"], 1))
    print(_row("get_computed_blocks (ns/hit block)", theirs["get_computed_blocks"],
               ours["get_computed_blocks"], 0))
    print(_row("allocate_slots (ns/new block)", theirs["allocate_slots"], ours["allocate_slots"], 0))
    print(_row("free (ns/block)", theirs["free"], ours["free"], 0))
    return {"vllm": theirs, "pagedkv": ours}


def _lengths(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the chosen workload on both managers, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_side_by_side",
                                     description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default_python = DEFAULT_VLLM_PYTHON
    parser.add_argument("--vllm-python", default=default_python, metavar="PATH",
                        help=f"the python of a virtual environment with vLLM (default {default_python})")
    parser.add_argument("--model", choices=("llama3", "gemma3", "jamba"), default="llama3")
    parser.add_argument("--hash", choices=tuple(HASHES), default="sha256",
                        help="sha256 on both sides, or fast: pagedkv xxh3_128 vs vLLM xxhash")
    parser.add_argument("--requests", type=int, default=STANDARD.num_requests, metavar="N")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="runs of each manager, alternating; medians (default 1)")
    parser.add_argument("--prompt-lengths", metavar="L,L,...", help="long prompts, e.g. 1k,8k,32k,128k")
    parser.add_argument("--repeats", type=int, default=4, metavar="N",
                        help="timed requests per prompt length (default 4)")
    parser.add_argument("--trace", metavar="PATH", help="a Mooncake JSONL trace")
    parser.add_argument("--block-size", type=int, default=512, metavar="N", help="with --trace (default 512)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="with --trace: first N requests")
    args = parser.parse_args(argv)
    runs = max(1, args.runs)
    if args.prompt_lengths:
        long_prompts_side_by_side(args.vllm_python, _lengths(args.prompt_lengths), args.hash, runs,
                                  args.repeats)
    elif args.trace:
        mooncake_side_by_side(args.vllm_python, args.trace, args.block_size, args.limit, args.hash, runs)
    else:
        standard_side_by_side(args.vllm_python, args.model, args.hash, runs, args.requests)
    print("reproduce: .venv/bin/python -m bench.vllm_side_by_side "
          + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
