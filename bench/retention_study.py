"""Which eviction policy keeps the right prefixes? A block-level prefix-cache
study on the Mooncake traces (issue 34's measurement, before any manager code).

The model is a prefix cache the way vLLM and pagedkv run one, requests taken
one at a time in arrival order (as the Mooncake paper's Figure 9 does):

- a request's prompt is its chain of block ids (``hash_ids``; 512 tokens a
  block); only full blocks are cached (vLLM hashes full blocks only), and at
  least the prompt's last token is computed, so a hit covers at most
  ``(input_length - 1) // 512`` blocks;
- its hit is the longest prefix of its chain that is resident;
- its blocks stay pinned while it runs; the missing ones are admitted (the
  policy evicts one victim per admission once the cache is full); then it
  releases all its blocks, tail first, and they stay cached, evictable.

Two simplifications against a real engine: one request runs at a time (so the
only pinned blocks are its own), and a block that is resident but cut off from
its prefix is reused in place (vLLM would compute it again in a fresh block).

The model is :mod:`pagedkv.simulate.retention_model`, the policies
:mod:`pagedkv.simulate.retention_policies` (``pagedkv simulate --policy`` runs them too). Belady's MIN is the
offline optimum of this model: every block must be admitted, each costs one
slot, so evicting the block whose next use is farthest minimises misses; as a
block is used whenever a block below it is, a parent's next use is never later
than its children's, so MIN with ties broken toward the tail evicts leaves only
and the cache stays prefix-closed (a hit is then every resident block of the
prefix, and MIN bounds the hit count of every online policy).

Capacity is a fraction of a workload's *working set*: its distinct full blocks.

``python3 -m bench.retention_study TRACE [TRACE ...] [--limit N] [--fractions 0.05,0.1,0.25,0.5]
[--policies lru,...] [--system-prompt] [--out bench/results/retention_study.md] [--plot PNG]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pagedkv.simulate.retention_model import (
    BLOCK_TOKENS,
    ONLINE,
    POLICIES,
    UNANNOTATED,
    Request,
    Result,
    Workload,
    load_trace,
    run,
    simulate,
    system_prompt_workload,
    table,
)

__all__ = ["BLOCK_TOKENS", "ONLINE", "POLICIES", "UNANNOTATED", "Request", "Result", "Workload", "load_trace",
           "run", "simulate", "system_prompt_workload", "table", "reuse_profile", "plot", "main"]


def reuse_profile(workload: Workload, most: int = 5) -> str:
    """Markdown: how likely a block is used again after its k-th use, k = 1..most
    (the signal a frequency-aware online policy can read), and the share of
    block uses that are a block's last (what only the future tells)."""
    uses: dict[int, int] = {}
    for request in workload.requests:
        for block in request.blocks:
            uses[block] = uses.get(block, 0) + 1
    lines = ["| uses so far (k) | blocks with >= k uses | P(used again after the k-th use) |",
             "|---|---|---|"]
    for k in range(1, most + 1):
        reached = sum(1 for n in uses.values() if n >= k)
        again = sum(1 for n in uses.values() if n > k)
        lines.append(f"| {k} | {reached:,} | {again / reached:.3f} |" if reached else f"| {k} | 0 | - |")
    total = sum(uses.values())
    lines.append(f"\n{len(uses) / total:.1%} of {total:,} block uses are the block's last use.")
    return "\n".join(lines)


def plot(all_results: dict[str, list[Result]], path: str) -> None:
    """One panel per workload: block hit rate against capacity, a line per policy."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(all_results), figsize=(6 * len(all_results), 4.5))
    axes_list = list(axes) if len(all_results) > 1 else [axes]
    for axis, (name, results) in zip(axes_list, all_results.items()):
        for policy in dict.fromkeys(r.policy for r in results):
            points = sorted((r.capacity, r.block_hit_rate) for r in results if r.policy == policy)
            style = "k--" if policy == "min" else ("k-" if policy == "lru" else "-")
            axis.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                      label=policy, linewidth=2 if policy in ("lru", "min") else 1)
        axis.set_title(name, fontsize=9)
        axis.set_xscale("log")
        axis.set_xlabel("capacity (blocks of 512 tokens)")
        axis.set_ylabel("block hit rate")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.retention_study",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("traces", nargs="+", help="Mooncake JSONL trace files")
    parser.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    parser.add_argument("--fractions", default="0.05,0.1,0.25,0.5",
                        help="capacities, as fractions of the working set")
    parser.add_argument("--policies", default=",".join(["lru", *ONLINE, "min"]))
    parser.add_argument("--system-prompt", action="store_true",
                        help="also the system-prompt workload built from the first trace")
    parser.add_argument("--system-prompt-limit", type=int, default=3000,
                        help="chat requests of the system-prompt workload")
    parser.add_argument("--reuse-profile", action="store_true",
                        help="only print each trace's reuse profile (no simulation)")
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    parser.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    names = args.policies.split(",")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; known: {sorted(POLICIES)}")
    workloads = [load_trace(path, args.limit) for path in args.traces]
    if args.reuse_profile:
        for workload in workloads:
            print(f"\n## {workload.name}: reuse profile\n\n{reuse_profile(workload)}")
        return 0
    runs: list[tuple[Workload, list[str]]] = [(w, names) for w in workloads]
    if args.system_prompt:
        base = load_trace(args.traces[0], args.system_prompt_limit)
        runs.append((system_prompt_workload(base), [*names, "lru+pin", "lru+prio90"]))
    command = "python3 -m bench.retention_study " + " ".join(
        [Path(a).name if a in args.traces else a for a in (argv or sys.argv[1:])])
    report = ["# Retention study: eviction policies on the Mooncake traces", "",
              f"`{command}` (trace paths shortened to their names)"]
    all_results: dict[str, list[Result]] = {}
    for workload, policy_names in runs:
        results = run(workload, fractions, policy_names)
        all_results[workload.name] = results
        report += ["", f"## {workload.name}", "",
                   f"{len(workload.requests):,} requests, working set {workload.working_set:,} "
                   f"blocks, {sum(r.tokens for r in workload.requests) / 1e6:.1f} M prompt tokens",
                   table(results, fractions)]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.plot:
        plot(all_results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
