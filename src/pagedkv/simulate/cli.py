"""``pagedkv simulate TRACE``: replay a workload through real pagedkv managers.

What prefix hit rate a workload gets from a KV cache of a given size, what
it takes to reach the ideal, how many preemptions and how much queueing it
causes, and how replicas behind a router share it. docs/simulate.md has the
method and real runs.

Exit status: 0 simulated; 1 the planned memory (``--preset``/``--model``
with ``--memory``) cannot hold one request of ``--max-model-len`` tokens;
2 bad arguments or a malformed trace (the message names the line and field).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedkv.events.dynamo import DynamoNotInstalled
from pagedkv.simulate.analysis import analyze
from pagedkv.simulate.capacity import Capacity, parse_capacities, planned_config, single_group_config
from pagedkv.simulate.fleet import BUILTIN_ROUTERS, ROUTERS, run_fleet
from pagedkv.simulate.replica import MODES, SchedulerConfig
from pagedkv.simulate.report import print_table, report, run_summary, write_csv
from pagedkv.simulate.requests import PrefixHasher, TokenSource
from pagedkv.simulate.workload import FORMATS, SharedPrefix, load_workload
from pagedkv.spec import HASH_FUNCTIONS
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InsufficientMemoryError, PagedKVError

__all__ = ["main", "add_arguments", "run", "DESCRIPTION"]

DESCRIPTION = ("Replay a serving trace through real pagedkv managers: prefix hit rate per KV cache "
               "capacity against the ideal, queueing and preemptions, occupancy, reuse distances, "
               "and replicas behind a router.")
DEFAULT_CAPACITIES = "0.1x,0.25x,1x,inf"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _memory_arg(text: str) -> int:
    from pagedkv.plan import parse_memory

    try:
        return parse_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pagedkv simulate``."""
    parser.add_argument("trace", metavar="TRACE",
                        help="a Mooncake or Bailian-style JSONL file, an Azure/BurstGPT CSV, or 'chat' "
                             "(the standard chat trace)")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="trace format (default: by the extension and the first line)")
    parser.add_argument("--trace-block-tokens", type=_positive_int, default=None, metavar="N",
                        help="tokens per trace block id (default: 512 Mooncake, 16 Bailian and CSV)")
    parser.add_argument("--shared-prefix", type=_positive_int, default=None, metavar="TOKENS",
                        help="CSV traces: every prompt starts with one of --prefix-groups system "
                             "prompts of TOKENS tokens")
    parser.add_argument("--prefix-groups", type=_positive_int, default=1, metavar="G")
    parser.add_argument("--mode", choices=MODES, default="engine",
                        help="engine: scheduler loop with batching and decode (default); cache: requests "
                             "one at a time (the Mooncake paper's Fig. 9 setting)")
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--num-blocks", type=_positive_int, default=None, metavar="N",
                          help="blocks per replica, the null block included")
    capacity.add_argument("--capacity", default=None, metavar="LIST",
                          help=f"capacities to sweep: inf, working-set multiples (0.25x), token counts "
                               f"(1e6, 3M); default {DEFAULT_CAPACITIES}")
    capacity.add_argument("--preset", default=None, help="plan the pool of a built-in model (with --memory)")
    capacity.add_argument("--model", default=None, metavar="FILE",
                          help="plan the pool of a JSON/YAML model file (with --memory)")
    parser.add_argument("--memory", type=_memory_arg, default=None, metavar="SIZE",
                        help="KV cache memory per replica for --preset/--model: 40GiB, 512MiB...")
    parser.add_argument("--block-size", type=_positive_int, default=None, metavar="N",
                        help="tokens per KV block (default: the trace's block size: 512 for Mooncake)")
    parser.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                        help="default: the longest request of the trace")
    parser.add_argument("--replicas", type=_positive_int, default=1, metavar="N")
    parser.add_argument("--router", default="round-robin", metavar="NAME[,NAME...]",
                        help=f"with --replicas > 1: {', '.join(ROUTERS)}, a comma list; 'all' is the first "
                             f"three (dynamo needs NVIDIA Dynamo installed: docs/fleet.md)")
    parser.add_argument("--prefix-balance", type=_non_negative_float, default=1.0, metavar="W",
                        help="prefix-aware router: weight of load against tokens to prefill (default 1)")
    parser.add_argument("--dynamo-python", default=None, metavar="PATH",
                        help="--router dynamo: a python with ai-dynamo-runtime (default: $PAGEDKV_DYNAMO_PYTHON, "
                             "then ~/.cache/pagedkv/router-venv/bin/python)")
    parser.add_argument("--dynamo-overlap-weight", type=_non_negative_float, default=1.0, metavar="W",
                        help="--router dynamo: weight of prefill blocks against decode blocks (Dynamo's "
                             "overlap_score_weight, default 1)")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192)
    parser.add_argument("--step-ms", type=_non_negative_float, default=5.0,
                        help="fixed cost of an engine step (default 5 ms)")
    parser.add_argument("--prefill-ms-per-token", type=_non_negative_float, default=0.01,
                        help="default 0.01 ms (100k prefill tokens/s)")
    parser.add_argument("--decode-ms-per-seq", type=_non_negative_float, default=0.1,
                        help="cost of one decode request in a step (default 0.1 ms)")
    parser.add_argument("--hash-fn", choices=HASH_FUNCTIONS, default="xxh3_128",
                        help="prefix hash (default xxh3_128: fast; hit rates do not depend on it)")
    parser.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                        help="replay the first N requests only")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the synthetic tokens, shared prefixes and hashes (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write one CSV row per run")
    parser.add_argument("--plot", default=None, metavar="DIR",
                        help="also write PNG plots into DIR (needs pagedkv[plot]: matplotlib)")
    parser.add_argument("--no-reuse", action="store_true", help="skip the reuse-distance analysis")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _routers(text: str, replicas: int) -> list[str]:
    if replicas == 1:
        return ["-"]
    names: list[str] = []
    for name in (part.strip() for part in text.split(",")):
        names += BUILTIN_ROUTERS if name == "all" else [name]
    for name in names:
        if name not in ROUTERS:
            raise argparse.ArgumentTypeError(f"--router must be among {', '.join(ROUTERS)} or 'all', got {name!r}")
    return names


def _fail(as_json: bool, kind: str, message: str) -> None:
    if as_json:
        print(json.dumps({"error": kind, "message": message}))
    print(f"pagedkv simulate: error: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``pagedkv simulate``; return the exit status."""
    try:
        routers = _routers(args.router, args.replicas)
        if (args.preset or args.model) and args.memory is None:
            raise argparse.ArgumentTypeError("--preset/--model need --memory")
        if args.memory is not None and not (args.preset or args.model):
            raise argparse.ArgumentTypeError("--memory needs --preset or --model")
        if args.plot:
            from pagedkv.simulate.plots import matplotlib_available

            if not matplotlib_available():  # fail before a long replay, not after
                raise argparse.ArgumentTypeError("--plot needs matplotlib: pip install 'pagedkv[plot]'")
        scheduler = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.step_ms,
                                    args.prefill_ms_per_token, args.decode_ms_per_seq)
        shared = (SharedPrefix(args.shared_prefix, args.prefix_groups, args.seed)
                  if args.shared_prefix else None)
        workload = load_workload(args.trace, args.format, block_tokens=args.trace_block_tokens,
                                 shared_prefix=shared, seed=args.seed).limited(args.limit)
        cache_mode = args.mode == "cache"
        longest = max(r.input_length + (0 if cache_mode else r.output_length) for r in workload.requests)
        max_model_len = args.max_model_len or longest
        if max_model_len < longest:
            raise argparse.ArgumentTypeError(
                f"--max-model-len {max_model_len} is shorter than the trace's longest request ({longest} tokens)")
        configs: list[tuple[Capacity, KVCacheConfig]]
        model_name = None
        if args.preset or args.model:
            model_name, config, tokens = planned_config(args.preset, args.model, args.memory, max_model_len,
                                                        args.block_size, args.max_num_batched_tokens)
            # The ideal is computed at the attention block size (full-attention semantics).
            block_size = args.block_size or min(
                (g.kv_cache_spec.block_size for g in config.kv_cache_groups
                 if type(g.kv_cache_spec).__name__ != "MambaSpec"), default=16)
            configs = [(Capacity(f"{args.preset or 'model'}", config.num_blocks, tokens), config)]
        else:
            block_size = args.block_size or workload.block_tokens
        analysis = analyze(workload, block_size, output_blocks=not cache_mode, reuse=not args.no_reuse)
        if not (args.preset or args.model):
            if args.num_blocks is not None:
                capacities = [Capacity(str(args.num_blocks), args.num_blocks)]
            else:
                capacities = parse_capacities(args.capacity or DEFAULT_CAPACITIES, analysis, block_size)
            configs = [(c, single_group_config(c.num_blocks, block_size)) for c in capacities]
    except InsufficientMemoryError as error:
        _fail(args.json, "insufficient_memory", str(error))
        return 1
    except (argparse.ArgumentTypeError, PagedKVError, ValueError, OSError) as error:
        _fail(args.json, "invalid_input", str(error))
        return 2
    progress = not args.no_progress and sys.stderr.isatty()
    source = TokenSource(workload.block_tokens, args.seed)
    hasher = PrefixHasher(args.hash_fn, block_size, workload.block_tokens, str(args.seed))
    runs: list[dict[str, Any]] = []
    try:
        for capacity, config in configs:
            for router in routers:
                result = run_fleet(
                    workload, config, mode=args.mode, replicas=args.replicas,
                    router=router if router != "-" else "round-robin", scheduler=scheduler,
                    hash_fn=args.hash_fn, seed=args.seed, max_model_len=max_model_len,
                    balance=args.prefix_balance, progress=progress,
                    label=f"{capacity.label} {router}".strip(" -"), hasher=hasher, source=source,
                    dynamo_python=args.dynamo_python, dynamo_overlap_weight=args.dynamo_overlap_weight)
                runs.append(run_summary(result, capacity, analysis))
    except PagedKVError as error:  # the manager refused the configuration
        _fail(args.json, "invalid_config", str(error))
        return 2
    except (DynamoNotInstalled, ImportError) as error:  # --router dynamo without Dynamo or pagedkv[events]
        _fail(args.json, "missing_dependency", str(error))
        return 2
    settings = {"mode": args.mode, "hash_fn": args.hash_fn, "seed": args.seed, "limit": args.limit,
                "max_model_len": max_model_len, "model": model_name,
                "scheduler": {"max_num_seqs": scheduler.max_num_seqs,
                              "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                              "step_ms": scheduler.step_ms,
                              "prefill_ms_per_token": scheduler.prefill_ms_per_token,
                              "decode_ms_per_seq": scheduler.decode_ms_per_seq}}
    doc = report(workload, analysis, runs, settings)
    if args.json:
        print(json.dumps(doc))
    else:
        print_table(doc, sys.stdout)
    if args.csv:
        with open(args.csv, "w", encoding="utf-8", newline="") as handle:
            write_csv(doc, handle)
    if args.plot:
        from pagedkv.simulate.plots import plot_report

        paths = plot_report(doc, args.plot)
        if not args.json:
            print(f"  plots: {', '.join(paths)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``pagedkv simulate [ARGS...]``; returns the exit status."""
    words = sys.argv[1:] if argv is None else argv
    if any(word == "--policy" or word.startswith("--policy=") for word in words):
        # Eviction policies on the block-level cache model (docs/retention.md).
        from pagedkv.simulate.retention_cli import main as retention_main
        try:
            return retention_main(words)
        except SystemExit as exc:
            return int(exc.code or 0)
    parser = argparse.ArgumentParser(prog="pagedkv simulate", description=DESCRIPTION)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, 0 on --help
        return int(exc.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
