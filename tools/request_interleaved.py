"""Request creation, pagedkv beside vLLM 0.33 in ONE interpreter, creation by creation.

    nice .vllm-overlay/bin/python tools/request_interleaved.py [--reps 40] [--tokens 8192]

``bench/request_bench.py`` runs vLLM in a child process per round, so the two sides
are measured seconds apart; on a shared machine the load changes in between (issue 17's
figures moved by a third between runs). Here both sides live in the overlay venv
(vLLM plus pagedkv, ``tools/verify_vllm.py --overlay``): each repetition creates the
prompt once with vLLM's ``Request`` and once with ``pagedkv.optimized``'s
``make_request`` (the order alternates), so both see the same load. Same prompts,
block sizes and hash pairs as ``bench/request_bench.py``; ns per prompt token, the
median over ``--reps``. Not a CI benchmark: a measurement aid for D-HASH-15.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from pagedkv.optimized import KVCacheManager
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

BLOCK_SIZES = (16, 512)
HASH_PAIRS = (("sha256", "sha256"), ("xxh3_128", "xxhash"))
VOCAB = 128_000


def measure(tokens: int, reps: int) -> list[tuple[str, int, float, float]]:
    """(pagedkv hash, block size, pagedkv ns/token, vLLM ns/token) per configuration."""
    from vllm.sampling_params import SamplingParams  # the overlay's vLLM; untyped
    from vllm.utils import hashing
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(tokens)]
    params = SamplingParams(max_tokens=16)
    rows = []
    for ours, theirs in HASH_PAIRS:
        fn: Any = getattr(hashing, theirs)
        init_none_hash(fn)
        for block_size in BLOCK_SIZES:
            hasher = get_request_block_hasher(block_size, fn)
            config = KVCacheConfig(16, (), (KVCacheGroupSpec(("layer.0",), FullAttentionSpec(
                block_size, 8, 128, "bfloat16")),))
            manager = KVCacheManager(config, 1 << 20, hash_fn=ours)
            mine: list[int] = []
            other: list[int] = []
            for rep in range(reps):
                for side in ((0, 1) if rep % 2 == 0 else (1, 0)):
                    started = time.perf_counter_ns()
                    if side == 0:
                        manager.make_request(f"r{rep}", prompt)
                        mine.append(time.perf_counter_ns() - started)
                    else:
                        Request(f"r{rep}", prompt, params, None, block_hasher=hasher)
                        other.append(time.perf_counter_ns() - started)
            rows.append((ours, block_size, statistics.median(mine) / tokens, statistics.median(other) / tokens))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/request_interleaved.py",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=40, metavar="N", help="creations per side (default 40)")
    parser.add_argument("--tokens", type=int, default=8192, metavar="N", help="prompt length (default 8192)")
    args = parser.parse_args(argv)
    print(f"| block | hash (pagedkv vs vLLM) | pagedkv ns/token | vLLM ns/token | vLLM/pagedkv |  "
          f"({args.tokens}-token prompt, median of {args.reps}, interleaved)")
    print("|---:|---|---:|---:|---:|")
    for ours, block_size, mine, other in measure(args.tokens, args.reps):
        theirs = dict(HASH_PAIRS)[ours]
        print(f"| {block_size} | {ours} vs {theirs} | {mine:.1f} | {other:.1f} | {other / mine:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
