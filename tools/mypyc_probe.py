"""Does compiling ``pagedkv.optimized`` with mypyc pay? (issue 17; the answer, D-PERF-25: no.)

    .venv/bin/python tools/mypyc_probe.py [--modules free_queue,block_pool,...] [--keep DIR]
        [--tests tests/test_differential.py ...] [-- AB_OPTIMIZED_ARGS]

Builds a throw-away copy of the package (symlinks to the sources, laid out as pyproject's
``package-dir`` maps them) in a temporary folder, compiles the chosen ``optimized`` modules there
with mypyc (the sources are not touched), and then, with that folder first on ``PYTHONPATH`` so
the compiled modules load in place of the pure ones:

- runs ``bench.ab_optimized --baseline HEAD`` (the pure package of HEAD, imported under another
  name, against the compiled one, alternating runs in one process; pass its arguments after ``--``),
- with ``--tests``, runs those test files (``HYPOTHESIS_PROFILE=quick``) and prints pytest's summary.

The default module set is every module mypyc accepts and that the rest of the tree lets be
compiled: not ``__init__``, ``manager``, ``manager_reads``, ``manager_cache``, ``sub_block_ops`` (multiple inheritance),
``hisparse*`` (``pagedkv.vllm`` subclasses them in interpreted code), ``validation`` (its typed
parameters would raise mypyc's ``TypeError`` before the typed errors). Needs a C compiler.
A measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_COMPILED = ("__init__", "manager", "manager_reads", "manager_cache", "sub_block_ops", "validation")


def default_modules() -> list[str]:
    """Every ``optimized/**/*.py`` module (as ``package/module``) but those mypyc or the tree rule out
    (see the docstring)."""
    folder = ROOT / "optimized"
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.glob("**/*.py")
                  if p.stem not in NOT_COMPILED and not p.stem.startswith("hisparse") and p.parts[-2] != "tensor")


def link_tree(into: Path) -> None:
    """``into/pagedkv/...``: a symlink per source file, per pyproject's ``package-dir``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        target = into.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in (ROOT / folder).glob("*.py"):
            (target / source.name).symlink_to(source)
    (into / "pagedkv" / "py.typed").touch()


def main() -> int:
    """Build, then benchmark and optionally test the compiled copy."""
    argv = sys.argv[1:]
    ab_args = argv[argv.index("--") + 1:] if "--" in argv else ["--prompt-length", "8k", "--runs", "5"]
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="tools/mypyc_probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", help="comma-separated optimized module names (default: see above)")
    parser.add_argument("--keep", metavar="DIR", help="build in DIR and keep it (default: a temporary folder)")
    parser.add_argument("--tests", nargs="*", default=[], metavar="FILE", help="test files to run compiled")
    args = parser.parse_args(argv)
    modules = args.modules.split(",") if args.modules else default_modules()
    with tempfile.TemporaryDirectory(prefix="pagedkv-mypyc-") as tmp:
        tree = Path(args.keep).resolve() if args.keep else Path(tmp)
        tree.mkdir(parents=True, exist_ok=True)
        if not (tree / "pagedkv").exists():
            link_tree(tree)
        files = [f"pagedkv/optimized/{name}.py" for name in modules]
        mypyc = Path(sys.executable).with_name("mypyc")
        start = time.perf_counter()
        built = subprocess.run([str(mypyc), *files], cwd=tree, capture_output=True, text=True)
        print(f"mypyc of {len(files)} modules: {time.perf_counter() - start:.1f} s wall, exit {built.returncode}")
        if built.returncode:
            print(built.stdout[-4000:], built.stderr[-4000:])
            return built.returncode
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]))
        command = [sys.executable, "-m", "bench.ab_optimized", "--baseline", "HEAD", *ab_args]
        print("$ PYTHONPATH=<compiled tree> " + " ".join(command[1:]), flush=True)
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        if args.tests:
            env["HYPOTHESIS_PROFILE"] = "quick"
            tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    *args.tests], cwd=ROOT, env=env, capture_output=True, text=True)
            print("\n".join(line for line in tests.stdout.splitlines()
                            if line.startswith(("FAILED", "ERROR")) or " passed" in line or " failed" in line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
