"""``make bench`` sections for long prompts and the Mamba-align hybrid
(pagedkv only; ``bench.vllm_side_by_side`` puts vLLM beside them).

1. Long prompts: one full-attention group, block 16, prompts of 1k-128k
   tokens (half shared, half unique), one request at a time (create, look
   up, allocate the rest, free; ``bench/side_driver.py``). Cost per unit:
   ns per token of creation, per hit block of ``get_computed_blocks``, per
   new block of ``allocate_slots``, per held block of ``free``; and the cost
   at the longest prompt over the cost at the shortest (flat: ~1).
2. The standard chat trace on the Jamba-like hybrid with Mamba in mode
   ``align`` (the only mode vLLM 0.33 caches): µs per call.

Medians over runs on fresh managers. Run alone:
``.venv/bin/python -m bench.long_bench [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

from bench import side_driver as sd
from bench.vllm_side_by_side import pagedkv_manager
from pagedkv.trace import CALL_KINDS, DEFAULT_NUM_BLOCKS, STANDARD, TraceDriver, standard_trace

__all__ = ["run", "run_long_prompts", "run_align_trace", "LENGTHS"]

LENGTHS: tuple[int, ...] = (1024, 8192, 32768, 131072)
"""Prompt lengths (tokens) of the long-prompt section."""

_UNITS = ("make_request", "get_computed_blocks", "allocate_slots", "free")


def run_long_prompts(runs: int, repeats: int = 4, hash_fn: str = "sha256",
                     lengths: tuple[int, ...] = LENGTHS) -> list[dict[str, Any]]:
    """Per length, the median per-unit costs (ns) over ``runs`` fresh managers."""
    block_size = 16
    rows = []
    for length in lengths:
        prompts = sd.long_prompts(length, repeats)
        figures = []
        hits: list[int] = []
        for _ in range(runs):
            manager = pagedkv_manager("llama3", (repeats + 1) * (-(-length // block_size)) + 2, block_size,
                                      length + block_size, hash_fn)
            gc.collect()
            raw = sd.replay_one_at_a_time(prompts, block_size, manager.make_request,
                                          manager.get_computed_blocks, manager.allocate_slots, manager.free,
                                          skip_first=1)
            hits = raw["hits"]
            figures.append(sd.summarize(raw))
        rows.append({"prompt_tokens": length, "hit_tokens": hits[-1],
                     **{unit: statistics.median(f[unit] for f in figures) for unit in _UNITS}})
    return rows


def run_align_trace(runs: int, hash_fn: str = "sha256") -> dict[str, Any]:
    """The standard trace on jamba with Mamba ``align``: median µs per call."""
    per_call: dict[str, list[float]] = {kind: [] for kind in CALL_KINDS}
    totals = []
    for _ in range(runs):
        manager = pagedkv_manager("jamba", DEFAULT_NUM_BLOCKS["jamba"], STANDARD.block_size, 8192, hash_fn)
        driver = TraceDriver(manager)
        gc.collect()
        driver.run(standard_trace(STANDARD))
        for kind in CALL_KINDS:
            per_call[kind].append(driver.us_per_call(kind))
        totals.append(driver.manager_total_ns / 1e6)
    return {"us_per_call": {k: statistics.median(v) for k, v in per_call.items()},
            "manager_total_ms": statistics.median(totals), "runs": runs}


def run(quick: bool = False) -> dict[str, Any]:
    """Both sections; prints Markdown tables, returns the figures."""
    runs = 2 if quick else 5
    long_rows = run_long_prompts(runs, repeats=2 if quick else 4)
    print("\n## Long prompts (one full-attention group, block 16, sha256, half the prompt shared; "
          "one request at a time; median ns per unit)")
    print("| prompt tokens | hit tokens | creation (ns/token) | get_computed_blocks (ns/hit block) | "
          "allocate_slots (ns/new block) | free (ns/block) |\n|---|---|---|---|---|---|")
    for row in long_rows:
        print(f"| {row['prompt_tokens']} | {row['hit_tokens']} | " + " | ".join(
            f"{row[unit]:.0f}" for unit in _UNITS) + " |")
    first, last = long_rows[0], long_rows[-1]
    print(f"cost per unit at {last['prompt_tokens']} tokens over {first['prompt_tokens']} (flat: ~1): "
          + ", ".join(f"{unit} {last[unit] / first[unit]:.2f}" for unit in _UNITS))
    align = run_align_trace(runs)
    print(f"\n## Standard chat trace on jamba, Mamba align (sha256; median of {runs} runs)")
    print("| call | µs/call |\n|---|---|")
    for kind in ("get_computed_blocks", "allocate_slots", "free", "make_request"):
        print(f"| {kind} | {align['us_per_call'][kind]:.2f} |")
    print(f"| manager total (ms) | {align['manager_total_ms']:.1f} |")
    return {"long_prompts": long_rows, "jamba_align_trace": align}


def main() -> None:
    """``python -m bench.long_bench [--quick]``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
