"""Same-process A/B of ``pagedkv.optimized`` against the optimized package of
another git revision (default ``main``), on the one-request-at-a-time
workloads of ``bench.vllm_side_by_side`` (no vLLM needed).

On a shared, noisy machine the vLLM side of ``bench.vllm_side_by_side``
moves by tens of percent between invocations; this compares two pagedkv
revisions in one process, runs alternating (ABBA order), medians. The other
revision's ``optimized/`` directory is extracted with ``git archive`` and
imported under another name; it shares this checkout's ``pagedkv.spec``, so
only revisions whose optimized package works against the current spec can
be compared.

    .venv/bin/python -m bench.ab_optimized --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --block-size 16 --limit 2000 --runs 3
    .venv/bin/python -m bench.ab_optimized --prompt-length 32k --runs 5
    .venv/bin/python -m bench.ab_optimized --model jamba --runs 5   # the standard chat trace
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import side_driver as sd
from bench.vllm_side_by_side import kv_cache_config

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("make_request", "get_computed_blocks", "allocate_slots", "free", "manager_ms",
           "manager_and_creation_ms")


def _native_sources(rev: str) -> dict[str, list[str]]:
    """``SOURCES`` of revision ``rev``'s setup.py (module name -> C files), or
    {} for a revision without C modules."""
    found = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:setup.py"], capture_output=True, check=False)
    if found.returncode != 0:
        return {}
    for node in ast.parse(found.stdout).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SOURCES" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return {str(k): [str(f) for f in v] for k, v in value.items()}
    return {}


def _build_native(rev: str, name: str, into: Path) -> None:
    """Compile revision ``rev``'s C modules into the copied package ``name``
    under ``into``, as its setup.py would (without them the copy would run
    its pure-Python code: not the revision as installed). A failure leaves
    them out; the table then names the build each side ran."""
    setuptools = importlib.import_module("setuptools")  # untyped: imported as a value
    build_ext = importlib.import_module("setuptools.command.build_ext").build_ext
    modules = [setuptools.Extension(f"{name}.{module}", [str(into / name / Path(f).name) for f in files],
                         extra_compile_args=["-O2"])
               for module, files in _native_sources(rev).items()]
    if not modules:
        return
    command = build_ext(setuptools.Distribution({"ext_modules": modules}))
    command.build_lib = str(into)
    command.build_temp = str(into / "build-temp")
    try:
        command.ensure_finalized()
        command.run()
    except Exception as error:  # no compiler, or the revision's C does not build here
        print(f"bench.ab_optimized: {rev}'s C modules did not build ({error}); it runs pure Python",
              file=sys.stderr)


def import_revision(rev: str, into: Path) -> Any:
    """The ``optimized`` package of git revision ``rev``, imported as
    ``pagedkv_optimized_<rev>`` from a copy under ``into``, its C modules
    compiled as the revision's setup.py lists them."""
    name = "pagedkv_optimized_" + "".join(c if c.isalnum() else "_" for c in rev)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "optimized"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "optimized").rename(into / name)
    # The revision's absolute imports name pagedkv.optimized: point them at the copy,
    # or its modules would come from the installed package and the A/B compare the
    # current code with itself.
    for source in (into / name).rglob("*.py"):
        text = source.read_text()
        if "pagedkv.optimized" in text:
            source.write_text(re.sub(r"\bpagedkv\.optimized\b", name, text))
    _build_native(rev, name, into)
    sys.path.insert(0, str(into))
    return importlib.import_module(name)


def replay(package: Any, prompts: Iterable[list[int]], block_size: int, num_blocks: int,
           max_model_len: int, skip_first: int) -> dict[str, float]:
    """One replay on a fresh manager of ``package``; per-unit figures."""
    manager = package.KVCacheManager(kv_cache_config("llama3", num_blocks, block_size), max_model_len,
                                     hash_fn="sha256")
    gc.collect()
    raw = sd.replay_one_at_a_time(prompts, block_size, manager.make_request, manager.get_computed_blocks,
                                  manager.allocate_slots, manager.free, skip_first)
    return sd.summarize(raw)


def standard(package: Any, model: str) -> dict[str, float]:
    """One replay of the standard chat trace (sha256) on a fresh manager of
    ``package`` for ``model``: µs per call and the manager total in ms."""
    from bench.vllm_side_by_side import _trace_figures
    from pagedkv.trace import DEFAULT_NUM_BLOCKS, STANDARD, TraceDriver, standard_trace

    manager = package.KVCacheManager(kv_cache_config(model, DEFAULT_NUM_BLOCKS[model], STANDARD.block_size),
                                     8192, hash_fn="sha256")
    driver = TraceDriver(manager)
    gc.collect()
    for step in standard_trace(STANDARD):
        driver.apply(step)
    return _trace_figures(driver.time_ns, driver.calls, driver.prompt_tokens_hashed)


def alternate(rev: str, current: Any, runs: int, keys: Sequence[str],
              one_run: Callable[[Any], dict[str, float]]) -> tuple[Any, dict[str, dict[str, float]]]:
    """Import revision ``rev``'s package, run ``one_run`` on it and on
    ``current`` ``runs`` times each, alternating (ABBA: drift on the machine
    hits both sides); the baseline package and the medians of ``keys`` per
    side (``"baseline"``, ``"current"``)."""
    with tempfile.TemporaryDirectory(prefix="pagedkv-ab-") as tmp:
        baseline = import_revision(rev, Path(tmp))
        results: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
        for index in range(max(1, runs)):
            sides = [("baseline", baseline), ("current", current)]
            if index % 2:
                sides.reverse()
            for side, package in sides:
                results[side].append(one_run(package))
    return baseline, {side: {k: statistics.median(r[k] for r in rs) for k in keys} for side, rs in results.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run both revisions alternating, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.ab_optimized",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--baseline", default="main", metavar="REV", help="git revision (default main)")
    parser.add_argument("--runs", type=int, default=3, metavar="N", help="runs of each side (default 3)")
    parser.add_argument("--trace", metavar="PATH", help="a Mooncake JSONL trace")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="with --trace (default 16)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="with --trace: first N requests")
    parser.add_argument("--prompt-length", default="32k", metavar="L",
                        help="without --trace: long prompts of L tokens, block 16 (default 32k)")
    parser.add_argument("--model", choices=("llama3", "gemma3", "jamba"), default=None,
                        help="the standard chat trace on this model instead (jamba: Mamba align)")
    args = parser.parse_args(argv)
    import pagedkv.optimized as current

    if args.model:
        return _standard_ab(args, current, argv)

    skip_first = 0
    make_prompts: Callable[[], Iterable[list[int]]]
    if args.trace:
        block_size = args.block_size
        requests = sd.mooncake_requests(args.trace, args.limit)
        num_blocks = sum(-(-n // block_size) for n, _ in requests) + 2
        max_model_len = max(n for n, _ in requests) + block_size
        what = f"Mooncake {Path(args.trace).name}, {len(requests)} requests, block {block_size}"

        def make_prompts() -> Iterable[list[int]]:
            return sd.mooncake_prompts(requests)
    else:
        text = args.prompt_length.lower()
        length = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
        block_size, repeats, skip_first = 16, 4, 1
        num_blocks = (repeats + 1) * (-(-length // block_size)) + 2
        max_model_len = length + block_size
        prompts = sd.long_prompts(length, repeats)
        what = f"long prompts of {length} tokens, block 16, {repeats} timed requests"

        def make_prompts() -> Iterable[list[int]]:
            return prompts
    baseline, med = alternate(args.baseline, current, args.runs, FIGURES, lambda package: replay(
        package, make_prompts(), block_size, num_blocks, max_model_len, skip_first))
    builds = f"{baseline.native.build_name()} vs {current.native.build_name()} loops"
    print(f"\n### pagedkv optimized, {args.baseline} vs this checkout ({builds}): {what}; hash sha256; median of "
          f"{max(1, args.runs)} alternating run(s) in one process")
    print(f"| figure | {args.baseline} | this checkout | {args.baseline}/this |\n|---|---|---|---|")
    units = {"make_request": "ns/token", "get_computed_blocks": "ns/hit block",
             "allocate_slots": "ns/new block", "free": "ns/block", "manager_ms": "ms",
             "manager_and_creation_ms": "ms"}
    for key in FIGURES:
        before, after = med["baseline"][key], med["current"][key]
        print(f"| {key} ({units[key]}) | {before:.1f} | {after:.1f} | {before / after:.2f}× |")
    print("reproduce: .venv/bin/python -m bench.ab_optimized " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


def _standard_ab(args: argparse.Namespace, current: Any, argv: Sequence[str] | None) -> int:
    """``--model``: the standard chat trace, both revisions alternating (ABBA), medians."""
    keys = ("get_computed_blocks", "allocate_slots", "free", "manager_ms")
    _, med = alternate(args.baseline, current, args.runs, keys, lambda package: standard(package, args.model))
    print(f"\n### pagedkv optimized, {args.baseline} vs this checkout: standard chat trace, {args.model}, "
          f"sha256; median of {max(1, args.runs)} alternating run(s) in one process")
    print(f"| figure | {args.baseline} | this checkout | {args.baseline}/this |\n|---|---|---|---|")
    for key in keys:
        before, after = med["baseline"][key], med["current"][key]
        unit = "ms" if key == "manager_ms" else "µs/call"
        print(f"| {key} ({unit}) | {before:.2f} | {after:.2f} | {before / after:.2f}× |")
    print("reproduce: .venv/bin/python -m bench.ab_optimized " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
