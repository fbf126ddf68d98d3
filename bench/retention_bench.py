"""What retention costs per pool call (docs/retention.md; issue 34's speed item).

One workload, four optimized pools: the plain ``BlockPool`` (the default,
no retention layer), ``RetentionBlockPool(policy="lru")``,
``RetentionBlockPool(policy="lru-freq")`` (no annotation: the shared prefix
climbs the frequency levels, each request's blocks stay at level 0) and
``RetentionBlockPool(policy="priority")`` with every request's blocks under a
directive and a pinned shared prefix. Each round: a request takes
``--blocks`` new blocks (evicting cached ones once the pool is warm), caches
them, hits the shared prefix, gets its directive (priority pool), then frees
everything, tail first. Prints the mean microseconds per call of
``get_new_blocks``, ``touch`` and ``free_blocks`` (and ``retain``), best of
``--repeat`` runs, and each pool's ratio to the plain pool.

``python3 -m bench.retention_bench [--num-blocks 20000] [--blocks 16] [--rounds 5000] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.retention import RetentionBlockPool
from pagedkv.spec.types import BlockHash

__all__ = ["main", "measure"]


@dataclass
class _Request:
    all_token_ids: list[int]
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[object, ...] = ()


def measure(make: Callable[[], BlockPool], *, blocks: int, rounds: int, directives: bool) -> dict[str, float]:
    """Mean seconds per call of each pool operation over ``rounds`` rounds."""
    pool = make()
    request: Any = _Request(list(range(blocks * 16)))  # the fields a BlockStored event reads
    prefix = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, prefix, block_hashes=[BlockHash(b"p%d" % i) for i in range(4)], num_cached_blocks=0,
                           num_full_blocks=4, block_size=16, group_id=0)
    if isinstance(pool, RetentionBlockPool) and directives:
        pool.pin(prefix, ttl=None)
    pool.free_blocks(list(reversed(prefix)))
    spent = {"get_new_blocks": 0.0, "touch": 0.0, "free_blocks": 0.0, "retain": 0.0}
    clock = time.perf_counter
    for round_index in range(rounds):
        start = clock()
        ids = pool.get_new_blocks(blocks)
        spent["get_new_blocks"] += clock() - start
        hashes = [BlockHash(f"{round_index}:{i}".encode()) for i in range(blocks)]
        pool.cache_full_blocks(request, ids, block_hashes=hashes, num_cached_blocks=0, num_full_blocks=blocks,
                               block_size=16, group_id=0)
        start = clock()
        pool.touch(prefix)
        spent["touch"] += clock() - start
        if isinstance(pool, RetentionBlockPool) and directives:
            start = clock()
            pool.retain(ids, 20 + round_index % 60, 5.0)
            spent["retain"] += clock() - start
        start = clock()
        pool.free_blocks(list(reversed(prefix + ids)))
        spent["free_blocks"] += clock() - start
    return {name: seconds / rounds for name, seconds in spent.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.retention_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=20000)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    pools: dict[str, tuple[Callable[[], BlockPool], bool]] = {
        "plain BlockPool (default)": (lambda: BlockPool(args.num_blocks, True), False),
        "retention, lru": (lambda: RetentionBlockPool(args.num_blocks, True, policy="lru"), False),
        "retention, lru-freq": (lambda: RetentionBlockPool(args.num_blocks, True, policy="lru-freq"), False),
        "retention, priority + pins": (
            lambda: RetentionBlockPool(args.num_blocks, True, policy="priority", pin_budget=0.01), True),
    }
    results: dict[str, dict[str, float]] = {}
    for name, (make, directives) in pools.items():
        runs = [measure(make, blocks=args.blocks, rounds=args.rounds, directives=directives)
                for _ in range(args.repeat)]
        results[name] = {op: min(run[op] for run in runs) for op in runs[0]}
    base = results["plain BlockPool (default)"]
    print(f"{args.num_blocks} blocks, {args.blocks} blocks a request, {args.rounds} rounds, best of {args.repeat}\n")
    print("| pool | get_new_blocks (us) | touch (us) | free_blocks (us) | retain (us) |")
    print("|---|---|---|---|---|")
    for name, row in results.items():
        cells = [f"{row[op] * 1e6:.2f} ({row[op] / base[op]:.1f}x)" if base[op] else f"{row[op] * 1e6:.2f}"
                 for op in ("get_new_blocks", "touch", "free_blocks")]
        print(f"| {name} | " + " | ".join(cells) + f" | {row['retain'] * 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
