"""Manager benchmarks: the standard chat trace, an eviction-heavy variant, and
allocate/free micro-benchmarks over pool size.

Only the manager calls are timed: ``time.perf_counter_ns()`` around each call
(``pagedkv.trace.TraceDriver``), accumulated per call kind. Trace generation,
request bookkeeping and result checks fall outside the timers. Each figure is
the median over runs (each run on a fresh manager); the garbage collector is
run before each run and stays enabled during it, as in an engine.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

from pagedkv.trace import (
    CALL_KINDS,
    STANDARD,
    Step,
    TraceConfig,
    TraceDriver,
    make_manager,
    peak_blocks,
    standard_trace,
)

__all__ = ["trace_steps", "run_trace", "eviction_num_blocks", "count_evictions", "run_micro",
           "MICRO_BLOCKS", "MICRO_POOLS"]

MICRO_BLOCKS: tuple[int, ...] = (1, 10, 100, 1000)
"""Blocks per allocation in the micro-benchmarks."""

MICRO_POOLS: tuple[int, ...] = (1 << 10, 1 << 20)
"""Pool sizes (blocks, null block included) of the micro-benchmarks."""

_EVICTION_MARGIN = 128

_steps_cache: dict[TraceConfig, list[Step]] = {}


def trace_steps(config: TraceConfig = STANDARD) -> list[Step]:
    """The trace's steps, generated once per config and kept."""
    steps = _steps_cache.get(config)
    if steps is None:
        steps = _steps_cache[config] = list(standard_trace(config))
    return steps


def _one_trace_run(implementation: str, hash_fn: str, config: TraceConfig, num_blocks: int) -> dict[str, Any]:
    manager = make_manager(implementation, num_blocks=num_blocks, block_size=config.block_size,
                           hash_fn=hash_fn)
    driver = TraceDriver(manager)
    steps = trace_steps(config)
    gc.collect()
    started = time.perf_counter()
    driver.run(steps)
    wall = time.perf_counter() - started
    per_call = {kind: driver.us_per_call(kind) for kind in CALL_KINDS}
    return {
        "manager_total_ms": driver.manager_total_ns / 1e6,
        "us_per_call": per_call,
        "calls": dict(driver.calls),
        "total_ms": {kind: ns / 1e6 for kind, ns in driver.time_ns.items()},
        "request_creation_us_per_token": driver.time_ns["make_request"] / 1000 / driver.prompt_tokens_hashed,
        "wall_s": wall,
    }


def run_trace(implementation: str, hash_fn: str, runs: int, config: TraceConfig = STANDARD,
              num_blocks: int = 8192) -> dict[str, Any]:
    """Replay the trace ``runs`` times on fresh managers; medians of every figure.

    Returns ``manager_total_ms``, ``us_per_call`` (per kind),
    ``request_creation_us_per_token``, ``calls``, ``runs`` and the per-run
    totals in ``manager_total_ms_runs``.
    """
    results = [_one_trace_run(implementation, hash_fn, config, num_blocks) for _ in range(runs)]
    return {
        "implementation": implementation,
        "hash_fn": hash_fn,
        "num_blocks": num_blocks,
        "runs": runs,
        "manager_total_ms": statistics.median(r["manager_total_ms"] for r in results),
        "manager_total_ms_runs": [r["manager_total_ms"] for r in results],
        "us_per_call": {kind: statistics.median(r["us_per_call"][kind] for r in results)
                        for kind in CALL_KINDS},
        "request_creation_us_per_token": statistics.median(
            r["request_creation_us_per_token"] for r in results),
        "calls": results[0]["calls"],
        "wall_s": statistics.median(r["wall_s"] for r in results),
    }


def eviction_num_blocks(config: TraceConfig = STANDARD) -> int:
    """A pool just large enough for the trace's peak (plus a small margin): after
    the first batch nearly every allocation pops a block that still carries a
    hash, so the manager keeps evicting cached blocks."""
    return peak_blocks(config) + 1 + _EVICTION_MARGIN


def count_evictions(config: TraceConfig, num_blocks: int, hash_fn: str = "sha256") -> int:
    """``BlockRemoved`` events of one untimed replay on the optimized manager
    (shows that a variant really evicts)."""
    manager = make_manager("optimized", num_blocks=num_blocks, block_size=config.block_size,
                           hash_fn=hash_fn, enable_kv_cache_events=True)
    driver = TraceDriver(manager)
    removed = 0
    for step in trace_steps(config):
        driver.apply(step)
        for event in manager.take_events():
            if type(event).__name__ == "BlockRemoved":
                removed += len(getattr(event, "block_hashes", ()))
    return removed


def run_micro(implementation: str, pool_blocks: int, sizes: Sequence[int] = MICRO_BLOCKS,
              reps: int = 200, block_size: int = 16) -> dict[str, Any]:
    """Allocate ``n`` blocks for one request (``allocate_slots(request, n * block_size)``
    on a fresh request) and free them, ``reps`` times per ``n``, on a manager
    of ``pool_blocks`` blocks with prefix caching off (pure pool work: pops from
    and pushes to the free queue, no hashing, no eviction).

    Returns, per ``n``, the median µs of ``allocate_slots`` and of ``free`` and the
    construction time of the manager.
    """
    max_tokens = max(sizes) * block_size
    started = time.perf_counter()
    manager = make_manager(implementation, num_blocks=pool_blocks, block_size=block_size,
                           max_model_len=max_tokens, enable_caching=False, hash_fn="xxh3_128")
    construct_s = time.perf_counter() - started
    clock = time.perf_counter_ns
    out: dict[str, Any] = {"implementation": implementation, "pool_blocks": pool_blocks,
                           "reps": reps, "construct_s": construct_s, "sizes": {}}
    for n in sizes:
        if n > pool_blocks - 1:
            continue
        tokens = n * block_size
        request = manager.make_request(f"micro-{n}", [i % 32000 for i in range(tokens)])
        alloc_ns: list[int] = []
        free_ns: list[int] = []
        gc.collect()
        for _ in range(reps):
            request.num_computed_tokens = 0
            start = clock()
            blocks = manager.allocate_slots(request, tokens)
            middle = clock()
            manager.free(request)
            end = clock()
            if blocks is None:
                raise RuntimeError(f"micro-benchmark: {n} blocks refused by a {pool_blocks}-block pool")
            alloc_ns.append(middle - start)
            free_ns.append(end - middle)
        out["sizes"][str(n)] = {
            "allocate_us": statistics.median(alloc_ns) / 1000,
            "free_us": statistics.median(free_ns) / 1000,
        }
    return out
