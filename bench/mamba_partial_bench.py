"""``make bench`` section: a Mamba-align hybrid whose Mamba block exceeds the
hash block, so prefix hits land inside a Mamba block and take a copy-on-write
copy (spec/mamba.md, "Sub-block hits"; issue 11).

Model: one full-attention group (block 16) and one Mamba group in mode
``align`` with blocks of 64 tokens, hashed every 16 tokens, sub-block hits on
(``enable_partial_hash_hits``). Workload: multi-turn chats. Every
conversation opens with a 1000-token system prompt shared by all; each turn
re-sends the whole conversation so far plus a 37-token user message, is
prefilled in chunks of 512, decodes a 32-token answer one token per step,
then is freed. A turn's prompt ends inside a Mamba block, so the producer
publishes its last boundary under a partial key and the next turn hits there
(a sub-block hit) and copies that state block. The engine side drains the
copies after each allocation and releases their retentions at once.

Only the manager calls are timed (``time.perf_counter_ns`` around each);
medians over fresh managers. Reported: µs per call, the share of turns
whose hit ended inside a Mamba block, copies per turn, and optimized over
reference time (same workload, same process). Run alone:
``.venv/bin/python -m bench.mamba_partial_bench [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from pagedkv import optimized, reference
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["run", "run_chats", "FULL_BLOCK", "MAMBA_BLOCK", "HASH_BLOCK"]

FULL_BLOCK = 16
MAMBA_BLOCK = 64
HASH_BLOCK = 16
SYSTEM_TOKENS = 1000
USER_TOKENS = 37
ANSWER_TOKENS = 32
CHUNK = 512
CALLS = ("make_request", "get_computed_blocks", "allocate_slots", "free", "copies")


def _manager(module: Any, num_blocks: int) -> Any:
    groups = (KVCacheGroupSpec(("attn",), FullAttentionSpec(FULL_BLOCK, 8, 128, "bfloat16")),
              KVCacheGroupSpec(("mamba",), MambaSpec(MAMBA_BLOCK, shapes=((16, 64),), dtypes=("bfloat16",),
                                                     mamba_cache_mode="align")))
    manager = module.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 16384,
                                    hash_block_size=HASH_BLOCK, hash_fn="xxh3_128")
    manager.enable_partial_hash_hits()
    return manager


def run_chats(module: Any, conversations: int, turns: int, seed: int = 0) -> dict[str, Any]:
    """One pass of the workload on a fresh manager of ``module``: ns per call
    kind, call counts, turns with a sub-block hit, copies taken."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(SYSTEM_TOKENS)]
    history = [list(system) for _ in range(conversations)]
    longest = SYSTEM_TOKENS + turns * (USER_TOKENS + ANSWER_TOKENS)
    manager = _manager(module, conversations * (-(-longest // FULL_BLOCK) + 8) + 64)
    spent = dict.fromkeys(CALLS, 0)
    counts = dict.fromkeys(CALLS, 0)
    partial_hits = copies = 0

    def timed(kind: str, call: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter_ns()
        result = call(*args)
        spent[kind] += time.perf_counter_ns() - started
        counts[kind] += 1
        return result

    def drain() -> int:
        pairs, retained = timed("copies", manager.take_kv_cache_block_copies)
        if retained:
            manager.release_copy_retentions(retained)  # the engine ran the copies
        return len(pairs)

    gc.collect()
    for turn in range(turns):
        for index in range(conversations):
            prompt = history[index] + [rng.randrange(32000) for _ in range(USER_TOKENS)]
            request = timed("make_request", manager.make_request, f"c{index}t{turn}", prompt)
            hit, length = timed("get_computed_blocks", manager.get_computed_blocks, request)
            if length % MAMBA_BLOCK:
                partial_hits += 1
            first = min(CHUNK, len(prompt) - length)
            assert timed("allocate_slots", manager.allocate_slots, request, first, length, hit) is not None
            request.num_computed_tokens = length + first
            copies += drain()
            while request.num_computed_tokens < len(prompt):
                step = min(CHUNK, len(prompt) - request.num_computed_tokens)
                assert timed("allocate_slots", manager.allocate_slots, request, step) is not None
                request.num_computed_tokens += step
                copies += drain()
            for _ in range(ANSWER_TOKENS - 1):
                request.append_output_token_ids(rng.randrange(32000))
                assert timed("allocate_slots", manager.allocate_slots, request, 1) is not None
                request.num_computed_tokens += 1
                copies += drain()
            history[index] = list(request.all_token_ids)
            timed("free", manager.free, request)
            manager.new_step_starts()
    return {"ns": spent, "calls": counts, "turns": turns * conversations,
            "partial_hits": partial_hits, "copies": copies}


def run(quick: bool = False) -> dict[str, Any]:
    """The section: prints a Markdown table, returns the figures."""
    conversations, turns = (8, 3) if quick else (32, 6)
    runs, reference_runs = (2, 1) if quick else (5, 1)
    results: dict[str, Any] = {}
    for name, module, count in (("optimized", optimized, runs), ("reference", reference, reference_runs)):
        passes = [run_chats(module, conversations, turns) for _ in range(count)]
        results[name] = {
            "us_per_call": {kind: statistics.median(p["ns"][kind] / max(p["calls"][kind], 1) / 1000
                                                    for p in passes) for kind in CALLS},
            "total_ms": statistics.median(sum(p["ns"].values()) / 1e6 for p in passes),
            "calls": passes[0]["calls"], "turns": passes[0]["turns"],
            "partial_hits": passes[0]["partial_hits"], "copies": passes[0]["copies"], "runs": count,
        }
    opt, ref = results["optimized"], results["reference"]
    # Both implementations must have served the same hits and copies.
    assert (opt["partial_hits"], opt["copies"]) == (ref["partial_hits"], ref["copies"])
    print(f"\n## Mamba align with sub-block hits (full block {FULL_BLOCK}, Mamba block {MAMBA_BLOCK}, "
          f"hash block {HASH_BLOCK}; {conversations} chats x {turns} turns; median of {runs} runs, "
          f"reference {reference_runs})")
    print(f"turns {opt['turns']}, hits inside a Mamba block {opt['partial_hits']}, copy-on-write copies "
          f"{opt['copies']} ({opt['copies'] / opt['turns']:.2f} per turn)")
    print("| call | optimized µs/call | reference µs/call | opt/ref |\n|---|---|---|---|")
    for kind in CALLS:
        o, r = opt["us_per_call"][kind], ref["us_per_call"][kind]
        print(f"| {kind} | {o:.2f} | {r:.2f} | {o / r if r else float('nan'):.2f} |")
    print(f"| manager total (ms) | {opt['total_ms']:.1f} | {ref['total_ms']:.1f} | "
          f"{opt['total_ms'] / ref['total_ms']:.2f} |")
    return {"mamba_partial_hits": results, "conversations": conversations, "turns": turns}


def main() -> None:
    """``python -m bench.mamba_partial_bench [--quick]``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer chats, turns and runs")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
