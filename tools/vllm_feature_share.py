"""Share of vLLM 0.33's core tests that pass with pagedkv, per feature area.

Feature-level targets ("tests touching these features pass for >= 95% of those
that pass on vLLM") need the tests of one area, not a whole file. This tool
collects vLLM's ``tests/v1/core`` ids, keeps those whose test name matches an
area's keywords (a file-wide area counts all of that file), leaves out the ids
that fail on stock vLLM, and counts how many of the rest fail with pagedkv.
It reads what ``tools/verify_vllm.py`` wrote; run that first.

    make verify-vllm && python3 tools/vllm_feature_share.py
    # or, for a checkout's own overlay:
    python3 tools/verify_vllm.py --overlay $PWD/.vllm-overlay --results $PWD/.vllm-results --reuse-stock
    python3 tools/vllm_feature_share.py --overlay $PWD/.vllm-overlay --results $PWD/.vllm-results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

CACHE = Path.home() / ".cache" / "pagedkv"
TOOLS = Path(__file__).resolve().parent

# Area -> (keywords matched against the test's name, files counted whole).
AREAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "host-resident groups (HiSparse)": (r"hisparse|host", ()),
    "newer spec types (SWA-MLA, rings, R-SWA, encoder-only, non-causal, MLA pages)": (
        r"circular|contiguous|sliding_window_mla|swa_mla|rswa|r_swa|encoder_only|non_causal|mla|compress|uniform_type",
        ("test_contiguous_kv_packing.py",)),
    "events and stats": (r"event|stats|metric", ("test_kv_cache_metrics.py",)),
}


def collect(python: Path, root: Path) -> list[str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(TOOLS), str(root)]))
    done = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-p", "vllm_core_plugin",
         "--rootdir", str(root), "-o", "addopts=", "--collect-only", "tests/v1/core"],
        cwd=root, env=env, capture_output=True, text=True, check=False)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"collected no tests (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overlay", type=Path,
                        default=Path(os.environ.get("VLLM_OVERLAY") or os.environ.get("VLLM_VENV")
                                     or CACHE / "vllm-venv"),
                        help="the venv verify_vllm.py ran pagedkv in (its --overlay, else its --venv; "
                             "default $VLLM_OVERLAY, else $VLLM_VENV, else ~/.cache/pagedkv/vllm-venv)")
    parser.add_argument("--results", type=Path, default=CACHE / "results",
                        help="verify_vllm.py's --results folder (default: CACHE/results)")
    parser.add_argument("--stock", type=Path, default=CACHE / "results" / "stock.json")
    parser.add_argument("--vllm-tests", type=Path, default=CACHE / "vllm-0.33.0")
    parser.add_argument("--list", action="store_true", help="also print each failing id")
    args = parser.parse_args()
    stock_path = args.results / "stock.json"
    stock_fail = set(json.loads((stock_path if stock_path.exists() else args.stock).read_text())["_failures"])
    ours_fail = set(json.loads((args.results / "pagedkv.json").read_text())["_failures"])
    ids = collect(args.overlay / "bin" / "python", args.vllm_tests)
    print("| area | pass on vLLM | pass with pagedkv | share |\n|---|---:|---:|---:|")
    union: set[str] = set()
    union_fail: set[str] = set()
    for area, (keywords, whole_files) in AREAS.items():
        pattern = re.compile(keywords, re.I)
        chosen = [i for i in ids if pattern.search(i.split("::", 1)[1])
                  or any(i.split("::", 1)[0].endswith(f) for f in whole_files)]
        passing = [i for i in chosen if i not in stock_fail]
        failing = [i for i in passing if i in ours_fail]
        union.update(passing)
        union_fail.update(failing)
        print(f"| {area} | {len(passing)} | {len(passing) - len(failing)} | "
              f"{(len(passing) - len(failing)) / max(len(passing), 1):.1%} |")
        if args.list:
            for failed in failing:
                print(f"|   {failed} | | | |")
    print(f"| **all areas** | {len(union)} | {len(union) - len(union_fail)} | "
          f"{(len(union) - len(union_fail)) / max(len(union), 1):.1%} |")


if __name__ == "__main__":
    main()
