"""The floor of this design on a Mooncake trace: the pool's C loops alone.

An analysis, not a manager: it replays a Mooncake trace one request at a
time (as ``bench.vllm_side_by_side --trace`` does) twice, alternating, on
fresh pools: once through ``KVCacheManager`` and once calling only the
pool's C loops (``optimized/_native.c``: ``prefix_hits`` for the lookup;
``admit``, which runs ``touch``, ``take``, ``map_run`` and ``key_run``,
for the allocation; ``release`` for the free), with no validation, no
stats, no result objects and no layers between them. That second replay is not a correct manager
(it checks nothing and handles no other case); it is the least time the
present data structures (a dict per group from hash to block id, plain
lists of ints indexed by block id) can take for the same pool work, so
it bounds what any further trimming of the Python around the loops can
win. Both replays must find the same hits.

``.venv/bin/python -m bench.pool_floor [--block-size 512] [--limit N] [--runs 3]``
(needs the C modules; the trace defaults to the conversation trace in $PAGEDKV_TRACES or ../shared/traces).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import side_driver as sd
from bench.locations import mooncake_trace
from bench.vllm_side_by_side import pagedkv_manager
from pagedkv.optimized import KVCacheManager
from pagedkv.optimized.native import NATIVE, AdmitContext

__all__ = ["bare_calls", "main"]

DEFAULT_TRACE = mooncake_trace()

Calls = tuple[Callable[[Any], Any], Callable[[Any, int, int, Any], Any], Callable[[Any], None]]


def bare_calls(manager: KVCacheManager, block_size: int) -> Calls:
    """Lookup, allocate and free for ``manager``'s one full-attention group
    as bare calls of the C loops over its pool (see the module docstring:
    a bound, not a manager). Requests must be new, hit blocks unchanged
    between lookup and allocation, and the pool large enough."""
    assert NATIVE is not None, "the C modules are not built"
    native = NATIVE
    pool = manager.block_pool
    queue = pool._queue
    table = pool.cached_by_group[0]
    ref, prev, nxt, hashes, gids, key_tokens = pool._ref, queue.prev, queue.next, pool._hash, pool._gid, \
        pool._key_tokens
    maps = (gids, pool.cached_by_group, pool.dup_by_group, pool)
    held: dict[str, list[int]] = {}
    context = AdmitContext(ref, prev, nxt, queue.sentinel, hashes, gids, key_tokens, table, pool._evict, maps,
                           block_size)

    def lookup(request: Any) -> tuple[list[int], int]:
        hit = native.prefix_hits(table, request.block_hashes, (request.num_tokens - 1) // block_size)
        assert hit is not None
        return hit, len(hit) * block_size

    def allocate(request: Any, num_new_tokens: int, hit_tokens: int, hit: list[int]) -> list[int]:
        blocks = list(hit)
        missing = -(-request.num_tokens // block_size) - len(hit)
        full = min(request.num_tokens // block_size, len(request.block_hashes))
        done = native.admit(context, blocks, missing, request.block_hashes, full)
        assert done is not None
        moved, new, keyed = done
        assert new is not None
        queue.size -= moved + missing
        if full > len(hit) and keyed is not True:  # a key cached already (a whole prompt recomputed)
            pool.cache_full_blocks_unchecked(request, blocks, block_hashes=request.block_hashes,
                                             num_cached_blocks=len(hit), num_full_blocks=full,
                                             block_size=block_size, group_id=0, mask=None)
        held[request.request_id] = blocks
        return new

    def free(request: Any) -> None:
        blocks = held.pop(request.request_id)
        blocks.reverse()
        released = native.release(ref, gids, prev, nxt, queue.sentinel, blocks)
        assert released is not None
        queue.size += released

    return lookup, allocate, free


def _replay(requests: Sequence[tuple[int, list[int]]], block_size: int, bare: bool) -> tuple[float, list[int]]:
    num_blocks = sum(-(-n // block_size) for n, _ in requests) + 2
    max_len = max(n for n, _ in requests) + block_size
    manager = pagedkv_manager("llama3", num_blocks, block_size, max_len, "sha256")
    calls: Any = bare_calls(manager, block_size) if bare else (
        manager.get_computed_blocks, manager.allocate_slots, manager.free)
    gc.collect()
    raw = sd.replay_one_at_a_time(sd.mooncake_prompts(requests), block_size, manager.make_request, *calls)
    ns = raw["ns"]
    return (ns["get_computed_blocks"] + ns["allocate_slots"] + ns["free"]) / 1e6, raw["hits"]


def main(argv: Sequence[str] | None = None) -> int:
    """Alternate the two replays; print the manager totals (medians) and their ratio."""
    parser = argparse.ArgumentParser(prog="python -m bench.pool_floor",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), metavar="PATH")
    parser.add_argument("--block-size", type=int, default=512, metavar="N")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests")
    parser.add_argument("--runs", type=int, default=3, metavar="N")
    args = parser.parse_args(argv)
    if NATIVE is None:
        print("bench.pool_floor needs the C modules (make install with a C compiler)", file=sys.stderr)
        return 2
    requests = sd.mooncake_requests(args.trace, args.limit)
    totals: dict[bool, list[float]] = {False: [], True: []}
    hits: dict[bool, list[int]] = {}
    for run in range(max(1, args.runs)):
        for bare in (False, True) if run % 2 == 0 else (True, False):
            print(f"  pool floor: run {run + 1}/{args.runs}, {'bare loops' if bare else 'manager'}", file=sys.stderr)
            total, hits[bare] = _replay(requests, args.block_size, bare)
            totals[bare].append(total)
    if hits[False] != hits[True]:
        raise SystemExit("the bare replay found other hits than the manager: the bound is void")
    manager, floor = statistics.median(totals[False]), statistics.median(totals[True])
    print(f"Mooncake trace {Path(args.trace).name}, {len(requests)} requests, block {args.block_size}, one at a "
          f"time, sha256; medians of {args.runs} alternating runs; hits identical ({sum(hits[True])} tokens)")
    print("| replay | get_computed_blocks + allocate_slots + free (ms) |\n|---|---|")
    print(f"| KVCacheManager | {manager:.1f} |\n| the pool's C loops alone (a floor) | {floor:.1f} |")
    print(f"floor / manager: {floor / manager:.2f}")
    print("reproduce: .venv/bin/python -m bench.pool_floor " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
