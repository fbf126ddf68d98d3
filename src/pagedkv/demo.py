"""``make demo``: the standard chat trace through the optimized manager, with the
reference model replaying every step in lockstep.

After every step both managers' return values must be equal, and after every
manager call (every step but ``AppendToken``, which touches only the request)
so must their ``snapshot()`` (the whole observable state: ref counts, hashes,
free-queue order, cached map, pending events, requests, statistics); then both
managers' pending events are taken (as an engine's scheduler does each step),
compared and counted. ``--check-every K`` compares snapshots after every K-th
manager call only (default 32, so the standard trace takes seconds rather than
minutes; the last step is always compared). The
demo prints the requests served, the prefix-cache hit rate, the peak usage,
the events, the optimized manager's time per call kind, and either "reference
and optimized agreed on N steps" or the first divergence with a diff of the
two snapshots.

Exit status: 0 when the managers agreed on every step, 1 on a divergence, 2
when the trace could not be replayed (both managers refused the same step).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any, TextIO

from pagedkv.spec import HASH_FUNCTIONS, ManagerSnapshot, PoolSnapshot
from pagedkv.trace import (
    CALL_KINDS,
    DEFAULT_NUM_BLOCKS,
    MANAGER_CALL_KINDS,
    MODELS,
    STANDARD,
    AddRequest,
    AppendToken,
    Step,
    TraceConfig,
    TraceDriver,
    make_manager,
    standard_trace,
)

__all__ = ["add_arguments", "run", "main", "diff_snapshots", "describe_step"]

DESCRIPTION = ("Replay the standard chat trace through the optimized manager, with the "
               "reference in lockstep, and report what happened.")
_PROGRESS_MIN_STEPS = 2000
_MAX_DIFF_LINES = 12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``pagedkv demo`` and ``python -m pagedkv.demo``)."""
    parser.add_argument("--requests", type=int, default=STANDARD.num_requests, metavar="N",
                        help="requests in the trace (default %(default)s, the standard trace)")
    parser.add_argument("--hash-fn", default="sha256", choices=HASH_FUNCTIONS,
                        help="prefix hash function (default %(default)s)")
    parser.add_argument("--model", default="llama3", choices=sorted(MODELS),
                        help="model shape: " + "; ".join(f"{name}: {text}" for name, text in MODELS.items()))
    parser.add_argument("--num-blocks", type=int, default=None, metavar="N",
                        help="blocks in the pool, the null block included (default: the model's, 8192 for llama3)")
    parser.add_argument("--no-reference", action="store_true",
                        help="run the optimized manager alone (no lockstep check)")
    parser.add_argument("--check-every", type=int, default=32, metavar="K",
                        help="compare snapshot() after every K-th manager call (default 32: about "
                             "15 s on 2 cores for the standard trace; 1: after each call, ~7 minutes; "
                             "return values and events are compared after every step)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def describe_step(step: Step) -> str:
    """A one-line description of a step (prompts abbreviated)."""
    if isinstance(step, AddRequest):
        tokens = step.prompt_token_ids
        return (f"AddRequest({step.request_id!r}, {len(tokens)} tokens "
                f"[{', '.join(map(str, tokens[:4]))}, ...])")
    return repr(step)


def _comparable(result: object) -> object:
    """The implementation-independent part of a step's result."""
    if result is None:
        return None
    if isinstance(result, tuple):  # get_computed_blocks: (blocks, hit tokens)
        blocks, hit = result
        return (tuple(blocks.get_block_ids()), hit)
    block_hashes = getattr(result, "block_hashes", None)
    if block_hashes is not None:  # a Request from make_request
        return ("request", tuple(block_hashes))
    get_block_ids = getattr(result, "get_block_ids", None)
    if get_block_ids is not None:  # KVCacheBlocks from allocate_slots
        return tuple(get_block_ids())
    return result


def _outcome(driver: TraceDriver, step: Step) -> tuple[object, ...]:
    """``("ok", comparable result)`` or ``("raised", error type, message)``."""
    try:
        result = driver.apply(step)
    except Exception as error:  # a divergence may be any error: report, never crash
        return ("raised", type(error).__name__, str(error))
    if isinstance(step, AppendToken):
        request = driver.requests[step.request_id]
        return ("ok", tuple(request.block_hashes[-1:]), request.num_tokens)
    return ("ok", _comparable(result))


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    if isinstance(value, bytes):
        text = value[:6].hex() + "…"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _diff_sequence(name: str, a: Sequence[object], b: Sequence[object]) -> list[str]:
    if a == b:
        return []
    lines = [f"{name}: {len(a)} vs {len(b)} entries"] if len(a) != len(b) else []
    differing = [i for i in range(min(len(a), len(b))) if a[i] != b[i]]
    for i in differing[:_MAX_DIFF_LINES]:
        lines.append(f"  {name}[{i}]: optimized {_short(a[i])} | reference {_short(b[i])}")
    if len(differing) > _MAX_DIFF_LINES:
        lines.append(f"  ... {len(differing) - _MAX_DIFF_LINES} more differing positions")
    if len(a) != len(b):
        longer, who = (a, "optimized") if len(a) > len(b) else (b, "reference")
        tail = longer[min(len(a), len(b)):]
        lines.append(f"  only in {who}: {_short(list(tail))}")
    return lines


def _diff_pool(a: PoolSnapshot, b: PoolSnapshot) -> list[str]:
    lines: list[str] = []
    if a.num_blocks != b.num_blocks:
        lines.append(f"pool.num_blocks: optimized {a.num_blocks} | reference {b.num_blocks}")
    lines += _diff_sequence("pool.ref_counts", a.ref_counts, b.ref_counts)
    lines += _diff_sequence("pool.block_hashes", a.block_hashes, b.block_hashes)
    lines += _diff_sequence("pool.free_queue", a.free_queue, b.free_queue)
    cached_a, cached_b = dict(a.cached), dict(b.cached)
    if cached_a != cached_b:
        keys = sorted(set(cached_a) | set(cached_b))
        changed = [k for k in keys if cached_a.get(k) != cached_b.get(k)]
        lines.append(f"pool.cached: {len(cached_a)} vs {len(cached_b)} keys, {len(changed)} differ")
        for key in changed[:_MAX_DIFF_LINES]:
            lines.append(f"  {key[:6].hex()}…: optimized {cached_a.get(key)} | "
                         f"reference {cached_b.get(key)}")
    lines += _diff_sequence("pool.pending_events", a.pending_events, b.pending_events)
    return lines


def diff_snapshots(a: ManagerSnapshot, b: ManagerSnapshot) -> list[str]:
    """Human-readable differences between two snapshots (``a`` optimized, ``b``
    reference); empty when they are equal. Long differences are abbreviated."""
    if a == b:
        return []
    lines = _diff_pool(a.pool, b.pool)
    requests_a = {r.request_id: r for r in a.requests}
    requests_b = {r.request_id: r for r in b.requests}
    for request_id in sorted(set(requests_a) | set(requests_b)):
        ra, rb = requests_a.get(request_id), requests_b.get(request_id)
        if ra != rb:
            lines.append(f"request {request_id!r}: optimized {_short(ra, 300)}")
            lines.append(f"{'':>{len(request_id) + 11}}reference {_short(rb, 300)}")
    if a.prefix_cache_stats != b.prefix_cache_stats:
        lines.append(f"prefix_cache_stats: optimized {a.prefix_cache_stats} | "
                     f"reference {b.prefix_cache_stats}")
    if not lines:  # equal field by field yet unequal: name the fields
        lines = [f.name for f in fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    return lines


def _progress(steps: list[Step], enabled: bool) -> Iterator[Step]:
    if not enabled or len(steps) < _PROGRESS_MIN_STEPS:
        return iter(steps)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dev extra: the demo runs without it
        return iter(steps)
    bar: Iterator[Step] = tqdm(steps, desc="demo", unit="step", file=sys.stderr,
                               mininterval=0.5, smoothing=0.1)
    return bar


def _report(config: TraceConfig, args: argparse.Namespace, driver: TraceDriver, manager: Any,
            events: Counter[str], peak_usage: float, wall_s: float, out: TextIO) -> None:
    stats = manager.make_prefix_cache_stats()
    if stats is not None and stats.queries:
        hit_rate = stats.hits / stats.queries
    else:  # no stats from the manager: the driver counted the same tokens
        hit_rate = driver.hit_tokens / driver.queried_tokens if driver.queried_tokens else 0.0
    print(f"pagedkv demo: the standard chat trace, {config.num_requests} requests "
          f"(prompts {config.system_prompt_tokens} shared + {config.unique_prompt_tokens} unique "
          f"tokens, {config.decode_steps} decode steps, batches of {config.batch_size}), "
          f"{args.num_blocks} blocks of {config.block_size} tokens, model {args.model} "
          f"({MODELS[args.model]}), hash {args.hash_fn}", file=out)
    print(f"  requests served      {driver.calls['free']}", file=out)
    print(f"  prefix hit rate      {hit_rate:.1%} of prompt tokens", file=out)
    print(f"  peak usage           {peak_usage:.1%} of the pool", file=out)
    event_text = ", ".join(f"{name} {count}" for name, count in sorted(events.items())) or "none"
    print(f"  events               {event_text}", file=out)
    note = "alone" if args.no_reference else "in lockstep with the reference: cold caches"
    print(f"  optimized manager time per call (events and stats on, {note}; `make bench` "
          "times it cleanly):", file=out)
    for kind in CALL_KINDS:
        calls = driver.calls[kind]
        if calls:
            print(f"    {kind:<20} {calls:>7} calls  {driver.us_per_call(kind):8.2f} µs/call  "
                  f"{driver.time_ns[kind] / 1e6:8.1f} ms", file=out)
    print(f"    {'manager total':<20} {'':>13}  {'':>13}  "
          f"{driver.manager_total_ns / 1e6:8.1f} ms  ({' + '.join(MANAGER_CALL_KINDS)})", file=out)
    print(f"  wall time            {wall_s:.1f} s", file=out)


def _print_divergence(index: int, total: int, step: Step, got: object, want: object,
                      snap_fast: ManagerSnapshot, snap_slow: ManagerSnapshot, out: TextIO) -> None:
    print(f"DIVERGENCE at step {index + 1} of {total}: {describe_step(step)}", file=out)
    print(f"  reference and optimized agreed on the {index} steps before it", file=out)
    if got != want:
        print(f"  optimized returned {_short(got, 400)}", file=out)
        print(f"  reference returned {_short(want, 400)}", file=out)
    diff = diff_snapshots(snap_fast, snap_slow)
    print("  snapshots (optimized vs reference):" if diff else "  snapshots are equal", file=out)
    for line in diff:
        print(f"    {line}", file=out)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the demo with parsed options, printing to ``out`` (default: the
    current ``sys.stdout``); return the exit status."""
    out = sys.stdout if out is None else out
    if args.requests < 1:
        print(f"--requests must be >= 1, got {args.requests}", file=sys.stderr)
        return 2
    config = TraceConfig(num_requests=args.requests)
    if args.num_blocks is None:
        args.num_blocks = DEFAULT_NUM_BLOCKS[args.model]
    options: dict[str, Any] = dict(num_blocks=args.num_blocks, model=args.model, hash_fn=args.hash_fn,
                                   log_stats=True, enable_kv_cache_events=True)
    optimized = make_manager("optimized", **options)
    reference = None if args.no_reference else make_manager("reference", **options)
    fast = TraceDriver(optimized)
    slow = None if reference is None else TraceDriver(reference)
    steps = list(standard_trace(config))
    events: Counter[str] = Counter()
    peak_usage = 0.0
    started = time.perf_counter()
    check_every = max(1, args.check_every)
    manager_calls = snapshots = 0
    for index, step in enumerate(_progress(steps, not args.no_progress)):
        got = _outcome(fast, step)
        if slow is None or reference is None:
            if got[0] == "raised":
                print(f"step {index + 1} ({describe_step(step)}) failed: {got[1]}: {got[2]}", file=out)
                return 2
        else:
            want = _outcome(slow, step)
            # An AppendToken step calls no manager method: its outcome (the
            # request's new block hashes) is compared, the managers are unchanged.
            calls_manager = not isinstance(step, AppendToken)
            manager_calls += calls_manager
            last = index == len(steps) - 1
            if got != want or last or (calls_manager and manager_calls % check_every == 0):
                snap_fast, snap_slow = optimized.snapshot(), reference.snapshot()
                snapshots += 1
                if got != want or snap_fast != snap_slow:
                    _print_divergence(index, len(steps), step, got, want, snap_fast, snap_slow, out)
                    return 1
            if got[0] == "raised":
                print(f"step {index + 1} ({describe_step(step)}): both managers raised "
                      f"{got[1]}: {got[2]}", file=out)
                return 2
            if reference.take_events() != (taken := optimized.take_events()):
                print(f"DIVERGENCE at step {index + 1}: take_events() differ", file=out)
                return 1
            events.update(type(event).__name__ for event in taken)
            peak_usage = max(peak_usage, optimized.usage)
            continue
        events.update(type(event).__name__ for event in optimized.take_events())
        peak_usage = max(peak_usage, optimized.usage)
    _report(config, args, fast, optimized, events, peak_usage, time.perf_counter() - started, out)
    if slow is None:
        print(f"(reference not run: --no-reference; {len(steps)} steps)", file=out)
    else:
        every = "each of" if check_every == 1 else f"every {check_every} of"
        print(f"reference and optimized agreed on {len(steps)} steps (return values and events "
              f"after every step; snapshot() after {every} the {manager_calls} manager calls "
              f"and at the end: {snapshots} snapshots)", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagedkv.demo [options]``."""
    parser = argparse.ArgumentParser(prog="pagedkv demo", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
