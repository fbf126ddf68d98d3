"""Benchmarks of the tensor path (``pagedkv.optimized.tensor``), on CUDA when
present, else on CPU.

1. Block-table update + slot mapping per engine step for (requests, tokens)
   in {(32, 512), (128, 2048), (256, 8192)}: every request appends the blocks
   its share of the tokens needs, one ``commit``, ``token_batch`` and
   ``slot_mapping``; µs per step (median).
2. Batched block copy and swap (device to host, host to device) for block
   sizes 4 KiB .. 2 MiB, as a fraction of the copy bandwidth measured in the
   same run with one large tensor copy of the same number of bytes (device to
   device for copy; host to device and device to host for swap).

``run(quick)`` prints Markdown tables and returns the figures; ``python -m
bench.tensor_bench [--quick]`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from pagedkv.optimized.tensor import BlockTables, KVCacheMemory, copy_blocks, swap_blocks, token_batch
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from pagedkv.spec.kv_cache_spec import FullAttentionSpec

__all__ = ["run"]

TABLE_CASES = ((32, 512), (128, 2048), (256, 8192))
BLOCK_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20)
BLOCK_SIZE = 16


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """A function timing one call of ``fn`` in seconds, device work included."""
    if device.type == "cuda":
        def timed(fn: Callable[[], None]) -> float:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return timed

    def timed_cpu(fn: Callable[[], None]) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    return timed_cpu


def _median(timed: Callable[[Callable[[], None]], float], fn: Callable[[], None],
            repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn) for _ in range(repeats))


def _table_step(device: torch.device, num_reqs: int, num_tokens: int, steps: int,
                timed: Callable[[Callable[[], None]], float]) -> dict[str, float]:
    tokens_per_req = num_tokens // num_reqs
    blocks_per_step = -(-tokens_per_req // BLOCK_SIZE)
    width = blocks_per_step * (steps + 2) + 1
    num_blocks = num_reqs * width + 1
    tables = BlockTables([BLOCK_SIZE], num_reqs, [width], num_blocks, device=device)
    for r in range(num_reqs):
        tables.add_request(r, [[1 + r * width]])
    counts = torch.full((num_reqs,), tokens_per_req, dtype=torch.int64, device=device)
    rows = torch.arange(num_reqs, device=device)
    state = {"step": 0}
    update_times: list[float] = []
    slot_times: list[float] = []

    def update() -> None:
        step = state["step"]
        for r in range(num_reqs):
            first = 2 + r * width + step * blocks_per_step
            tables.append_blocks(r, [list(range(first, first + blocks_per_step))])
        tables.commit()

    def slots() -> None:
        # The tokens of this step sit in the blocks just appended.
        starts = torch.full((num_reqs,), (1 + state["step"] * blocks_per_step) * BLOCK_SIZE,
                            dtype=torch.int64, device=device)
        token_rows, positions = token_batch(rows, starts, counts, tokens_per_req * num_reqs)
        tables.slot_mapping(token_rows, positions)

    for _ in range(steps):
        update_times.append(timed(update))
        slot_times.append(timed(slots))
        state["step"] += 1
    update_us = statistics.median(update_times[1:]) * 1e6
    slot_us = statistics.median(slot_times[1:]) * 1e6
    return {"requests": num_reqs, "tokens": num_tokens, "update_us": update_us,
            "slot_mapping_us": slot_us, "total_us": update_us + slot_us}


def _cache(device: torch.device, block_bytes: int, num_blocks: int) -> KVCacheMemory:
    # float16 K and V of 16 tokens: page = 64 * heads * head_size bytes.
    elements = block_bytes // 64
    head_size = min(elements, 128)
    spec = FullAttentionSpec(BLOCK_SIZE, elements // head_size, head_size, "float16")
    assert spec.page_size_bytes == block_bytes
    config = KVCacheConfig(num_blocks, (KVCacheTensor(num_blocks * block_bytes, ("layer",)),),
                           (KVCacheGroupSpec(("layer",), spec),))
    return KVCacheMemory(config, device)


def _bandwidths(device: torch.device, total_bytes: int, repeats: int,
                timed: Callable[[Callable[[], None]], float]) -> tuple[float, float, float]:
    """Bytes per second of one large copy: device to device, host to device,
    device to host. A function of its own so the buffers are freed on return."""
    pinned = device.type == "cuda"
    src = torch.ones(total_bytes, dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(total_bytes, dtype=torch.int8, pin_memory=pinned)

    def copy_d2d() -> None:
        dst.copy_(src)

    def copy_h2d() -> None:
        src.copy_(host, non_blocking=pinned)

    def copy_d2h() -> None:
        host.copy_(src)

    copy_bw = total_bytes / _median(timed, copy_d2d, repeats)
    h2d_bw = total_bytes / _median(timed, copy_h2d, repeats)
    d2h_bw = total_bytes / _median(timed, copy_d2h, repeats)
    return copy_bw, h2d_bw, d2h_bw


def _block_ops(device: torch.device, total_bytes: int, repeats: int,
               timed: Callable[[Callable[[], None]], float]) -> dict[str, object]:
    copy_bw, h2d_bw, d2h_bw = _bandwidths(device, total_bytes, repeats, timed)
    rows: list[dict[str, float]] = []
    for block_bytes in BLOCK_BYTES:
        n = max(1, total_bytes // block_bytes)
        cache = _cache(device, block_bytes, 2 * n + 1)
        mirror = KVCacheMemory.host_mirror(cache, n + 1)
        # Interleaved sources and destinations: no run of adjacent blocks to exploit.
        copy_pairs = [(1 + 2 * i, 2 + 2 * i) for i in range(n)]
        out_pairs = [(1 + 2 * i, 1 + i) for i in range(n)]
        in_pairs = [(1 + i, 2 + 2 * i) for i in range(n)]
        moved = n * block_bytes
        # partial, not lambda: binds this iteration's cache and pairs explicitly.
        copy_s = _median(timed, partial(copy_blocks, cache, copy_pairs), repeats)
        out_s = _median(timed, partial(swap_blocks, cache, mirror, out_pairs), repeats)
        in_s = _median(timed, partial(swap_blocks, mirror, cache, in_pairs), repeats)
        rows.append({
            "block_bytes": block_bytes, "pairs": n,
            "copy_GBps": moved / copy_s / 1e9, "copy_fraction": moved / copy_s / copy_bw,
            "swap_out_GBps": moved / out_s / 1e9, "swap_out_fraction": moved / out_s / d2h_bw,
            "swap_in_GBps": moved / in_s / 1e9, "swap_in_fraction": moved / in_s / h2d_bw,
        })
        del cache, mirror
    return {"bytes_per_batch": total_bytes, "copy_bandwidth_GBps": copy_bw / 1e9,
            "h2d_bandwidth_GBps": h2d_bw / 1e9, "d2h_bandwidth_GBps": d2h_bw / 1e9,
            "block_sizes": rows}


def _print(result: dict[str, object]) -> None:
    print(f"device: {result['device']}")
    print("\n| requests | tokens | table update µs | slot mapping µs | total µs/step |")
    print("|---|---|---|---|---|")
    for row in result["table_slot"]:  # type: ignore[attr-defined]
        print(f"| {row['requests']} | {row['tokens']} | {row['update_us']:.0f} | "
              f"{row['slot_mapping_us']:.0f} | {row['total_us']:.0f} |")
    ops = result["block_ops"]
    assert isinstance(ops, dict)
    print(f"\nreference bandwidth (one {ops['bytes_per_batch'] >> 20} MiB copy): device "
          f"{ops['copy_bandwidth_GBps']:.1f} GB/s, host→device {ops['h2d_bandwidth_GBps']:.1f} "
          f"GB/s, device→host {ops['d2h_bandwidth_GBps']:.1f} GB/s")
    print("\n| block | pairs | copy GB/s (fraction) | swap out GB/s (fraction) | "
          "swap in GB/s (fraction) |")
    print("|---|---|---|---|---|")
    for row in ops["block_sizes"]:
        print(f"| {row['block_bytes'] >> 10} KiB | {row['pairs']} | {row['copy_GBps']:.1f} "
              f"({row['copy_fraction']:.2f}) | {row['swap_out_GBps']:.1f} "
              f"({row['swap_out_fraction']:.2f}) | {row['swap_in_GBps']:.1f} "
              f"({row['swap_in_fraction']:.2f}) |")


def run(quick: bool = False) -> dict[str, object]:
    """Run both benchmarks on CUDA when available (else CPU), print Markdown
    tables and return the figures (plain values, JSON-ready)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timed = _timer(device)
    steps = 6 if quick else 21
    repeats = 3 if quick else 7
    if device.type == "cuda":
        total = (64 if quick else 256) << 20
    else:
        total = (8 if quick else 32) << 20
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "table_slot": [_table_step(device, r, t, steps, timed) for r, t in TABLE_CASES],
        "block_ops": _block_ops(device, total, repeats, timed),
    }
    _print(result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller batches")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    figures = run(quick=args.quick)
    if args.json:
        print(json.dumps(figures, indent=2))
