"""Request creation (prompt hashing included), pagedkv beside vLLM 0.33, ns per prompt token.

    .venv/bin/python -m bench.request_bench [--vllm-python PATH] [--rounds 5]

pagedkv: ``pagedkv.optimized.KVCacheManager.make_request(id, prompt)`` with one
full-attention group hashed at block size 16 and 512, with ``sha256`` (byte-identical
to vLLM's) and with the fast ``xxh3_128``. vLLM: its own ``Request(id, prompt,
SamplingParams, None, block_hasher=get_request_block_hasher(block_size, fn))`` with
``sha256`` and with ``xxhash`` (vLLM's fast hash), run in vLLM's interpreter as a
subprocess (nothing of vLLM is imported here). Each side creates the same prompts
(``--tokens`` random ids below 128,000, ``random.Random(0)``); the two sides
alternate, round by round, so drift on the machine hits both; a figure is the median
over rounds of the per-round median over ``--reps`` creations. Without vLLM (no
``--vllm-python`` and no venv from ``make vllm-venv``, ``bench/locations.py``) only
pagedkv's figures are printed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.locations import vllm_python
from pagedkv.optimized import KVCacheManager
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

BLOCK_SIZES = (16, 512)
# (pagedkv's hash, vLLM's hash of the same family): sha256 is byte-identical on both sides;
# the fast hashes differ in encoding (D-HASH-2) but fill the same role.
HASH_PAIRS = (("sha256", "sha256"), ("xxh3_128", "xxhash"))
VOCAB = 128_000
DEFAULT_VLLM_PYTHON = Path(vllm_python())

# Runs inside vLLM's interpreter: argv = [json of {"tokens", "reps", "configs"}].
_CHILD = r'''
import json, random, statistics, sys, time
args = json.loads(sys.argv[1])
from vllm.sampling_params import SamplingParams
from vllm.utils import hashing
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
prompt = [random.Random(0).randrange(args["vocab"]) for _ in range(args["tokens"])]
params = SamplingParams(max_tokens=16)
out = {}
for fn_name, block_size in args["configs"]:
    fn = getattr(hashing, fn_name)
    init_none_hash(fn)
    hasher = get_request_block_hasher(block_size, fn)
    times = []
    for rep in range(args["reps"]):
        started = time.perf_counter_ns()
        Request(f"r{rep}", prompt, params, None, block_hasher=hasher)
        times.append(time.perf_counter_ns() - started)
    out[f"{fn_name}/{block_size}"] = statistics.median(times) / len(prompt)
print(json.dumps(out))
'''


def _prompt(tokens: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(VOCAB) for _ in range(tokens)]


def run_pagedkv(tokens: int, reps: int) -> dict[str, float]:
    """Median ns per prompt token of ``make_request`` per ``hash/block size``."""
    prompt = _prompt(tokens)
    out: dict[str, float] = {}
    for hash_fn, _ in HASH_PAIRS:
        for block_size in BLOCK_SIZES:
            config = KVCacheConfig(16, (), (KVCacheGroupSpec(("layer.0",), FullAttentionSpec(
                block_size, 8, 128, "bfloat16")),))
            manager = KVCacheManager(config, 1 << 20, hash_fn=hash_fn)
            times = []
            for rep in range(reps):
                started = time.perf_counter_ns()
                manager.make_request(f"r{rep}", prompt)
                times.append(time.perf_counter_ns() - started)
            out[f"{hash_fn}/{block_size}"] = statistics.median(times) / tokens
    return out


def run_vllm(vllm_python: str, tokens: int, reps: int) -> dict[str, float]:
    """The same, for vLLM's ``Request`` in ``vllm_python``."""
    configs = [[vllm_fn, block_size] for _, vllm_fn in HASH_PAIRS for block_size in BLOCK_SIZES]
    done = subprocess.run(
        [vllm_python, "-c", _CHILD, json.dumps({"tokens": tokens, "reps": reps, "configs": configs,
                                                "vocab": VOCAB})],
        capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(quick: bool = False, vllm_python: str | None = None, rounds: int | None = None,
        tokens: int = 8192, reps: int | None = None) -> dict[str, Any]:
    """Alternate the sides ``rounds`` times; print the table; return the figures."""
    rounds = rounds if rounds is not None else (2 if quick else 5)
    reps = reps if reps is not None else (5 if quick else 15)
    python = vllm_python or (str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None)
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    for index in range(rounds):
        print(f"  request bench: round {index + 1}/{rounds}", file=sys.stderr, flush=True)
        if python is not None:
            theirs.append(run_vllm(python, tokens, reps))
        ours.append(run_pagedkv(tokens, reps))
    rows = []
    figures: dict[str, Any] = {"tokens": tokens, "rounds": rounds, "reps": reps, "vllm_python": python,
                               "ns_per_token": {}}
    for hash_fn, vllm_fn in HASH_PAIRS:
        for block_size in BLOCK_SIZES:
            mine = statistics.median(r[f"{hash_fn}/{block_size}"] for r in ours)
            other = (statistics.median(r[f"{vllm_fn}/{block_size}"] for r in theirs)
                     if theirs else None)
            figures["ns_per_token"][f"{hash_fn}/{block_size}"] = {"pagedkv": mine, "vllm": other}
            ratio = "–" if other is None else f"{other / mine:.2f}×"
            label = f"{hash_fn} vs vLLM {vllm_fn}"
            rows.append(f"| {block_size:>5} | {label:<28} | {mine:>8.1f} | "
                        f"{'–' if other is None else f'{other:.1f}':>8} | {ratio:>12} |")
    print(f"\n## Request creation, prompt hashing included ({tokens}-token prompts, ns per token; "
          f"median of {rounds} alternating rounds x {reps} creations)")
    print("| block | hash (pagedkv vs vLLM)       |  pagedkv |     vLLM | vLLM/pagedkv |")
    print("|------:|------------------------------|---------:|---------:|-------------:|")
    print("\n".join(rows))
    if python is None:
        print("(vLLM not found: pass --vllm-python; pagedkv figures only)")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_bench",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help=f"python of a venv with vLLM 0.33 (default {DEFAULT_VLLM_PYTHON} if present)")
    parser.add_argument("--rounds", type=int, default=5, metavar="N", help="alternating rounds (default 5)")
    parser.add_argument("--reps", type=int, default=15, metavar="N", help="creations per round (default 15)")
    parser.add_argument("--tokens", type=int, default=8192, metavar="N", help="prompt length (default 8192)")
    args = parser.parse_args(argv)
    run(vllm_python=args.vllm_python, rounds=args.rounds, tokens=args.tokens, reps=args.reps)
    print(f"reproduce: .venv/bin/python -m bench.request_bench --rounds {args.rounds} --reps {args.reps} "
          f"--tokens {args.tokens}" + (f" --vllm-python {args.vllm_python}" if args.vllm_python else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
