"""A small AST mutation tester for pagedkv (``make mutation``).

Why not cosmic-ray or mutmut: cosmic-ray (8.7) fits the strict editable
install (it mutates files in place, which the install links to) but enumerates
every mutant of every file with no sampling, thousands here, at 20-60 s of
tests each on this project's 2-core machines, and pulls ten runtime
dependencies; mutmut 3 runs the tests against a copied tree that the strict
editable install does not import. This tool draws a deterministic sample
instead and scores it per file.

Each mutant changes one AST node of one file under ``reference/`` or
``optimized/`` (``optimized/tensor`` excluded): a comparison flipped, an
arithmetic or boolean operator swapped, an integer constant moved by one, a
condition negated, a statement deleted. The file is patched in place (only
the node's source segment changes), its cached bytecode is deleted and the
tests run without writing bytecode (a same-size edit within the same second
would otherwise reuse the stale cache), and the file is restored. A mutant is *killed* when the tests
fail (or exceed the time limit), *survived* otherwise.

    python tools/mutate.py [--per-file N] [--seed S] [--files GLOB...] [--out FILE]
                           [--changed-since REV] [--tests PYTEST_ARG...] [--features]

``--features`` (``make mutation-features``) targets the reference's feature
modules (``reference/features/*.py``, the lines that moved out of the kernel
and the rules restated from spec/) and runs, per mutant, only the tests of
its module (``FEATURE_TESTS``): the whole feature suite per mutant would take
hours on two cores.

``--changed-since REV`` draws only mutants on lines that differ from git
revision ``REV`` (the lines a branch added or changed), so a re-run scores
the code that changed rather than a sample of whole files.

Survivors are listed with their diff; triage them in tools/mutation_triage.md
(equivalent, or killed by a test added since).
"""

from __future__ import annotations

import argparse
import ast
import copy
import fnmatch
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("reference/*.py", "reference/features/*.py", "optimized/*.py", "optimized/*/*.py")
SKIP = ("*/__init__.py", "reference/features/tensor_model.py", "reference/invariants.py",
        "optimized/coordination/coordinator_checks.py", "optimized/tensor/*.py")
#: Fast, sensitive tests first: ``-x`` stops at the first failure.
TESTS = ["tests/test_admit_path.py",
         "tests/test_scenarios.py", "tests/test_scenarios_hybrid.py", "tests/test_bad_input.py",
         "tests/test_edge_cases.py", "tests/test_optimized_unit.py", "tests/test_gates.py",
         "tests/test_hashing.py", "tests/test_fault_injection.py", "tests/test_kv_integrity.py",
         "tests/test_kv_integrity_state.py",
         "tests/test_differential.py", "tests/test_differential_hybrid.py"]

#: The narrow suites of the feature modules (``--features``): the tests that
#: exercise a module on both implementations, unit and scenario tests first
#: and the lockstep machine last (``-x`` stops at the first failure, so only
#: a mutant the fast tests miss pays for the machine).
_EDGES = "tests/test_feature_edges.py"
_KERNEL_FEATURES = ["tests/test_reference_kernel.py", "tests/test_connector_completes_state.py",
                    "tests/test_ring_scenarios.py", "tests/test_rswa_scenarios.py", "tests/test_scenarios_hybrid.py"]
_DCP = [_EDGES, "tests/test_dcp_partial_hits.py", "tests/test_eagle_sub_block.py", "tests/test_dcp_lockstep.py"]
_EAGLE = ["tests/test_eagle_groups.py", "tests/test_eagle_sub_block.py", "tests/test_eagle_retention.py"]
_HISPARSE = [_EDGES, "tests/test_hisparse_rules.py", "tests/test_hisparse.py", "tests/test_hisparse_steps.py",
             "tests/test_hisparse_vllm_scenarios.py", "tests/test_hisparse_lockstep.py"]
_MAMBA = [_EDGES, "tests/test_mamba_checkpoints.py", "tests/test_mamba_checkpoints_publish.py",
          "tests/test_mamba_partial_hits.py", "tests/test_eagle_retention.py", "tests/test_eagle_sub_block.py",
          "tests/test_mamba_partial_lockstep.py"]
_RETENTION = [_EDGES, "tests/test_retention.py", "tests/test_eagle_retention.py", "tests/test_mamba_partial_hits.py",
              "tests/test_retention_lockstep.py"]
#: The feature module -> its suite. Left out: the host tier's invariant
#: checker (hisparse_invariants), like reference/invariants.py (its mutants
#: are for the planted-bug gates); ``enabled`` (a list of classes, no
#: mutation point); ``tensor_model`` (the torch path's model, SKIP).
FEATURE_TESTS: dict[str, list[str]] = {
    "reference/features/connector_hits.py": _KERNEL_FEATURES,
    "reference/features/dcp_partial.py": _DCP,
    "reference/features/dcp_rules.py": _DCP,
    "reference/features/eagle.py": _EAGLE,
    "reference/features/eagle_rules.py": _EAGLE,
    "reference/features/hisparse.py": _HISPARSE,
    "reference/features/hisparse_rules.py": _HISPARSE,
    "reference/features/hisparse_state.py": _HISPARSE,
    "reference/features/hisparse_steps.py": _HISPARSE,
    "reference/features/mamba_checkpoint_rules.py": _MAMBA,
    "reference/features/mamba_partial.py": _MAMBA,
    "reference/features/mamba_partial_rules.py": _MAMBA,
    "reference/features/mamba_publish.py": _MAMBA,
    "reference/features/mamba_states.py": _MAMBA,
    "reference/features/operations.py": _RETENTION,
    # Recovery is the reference's own: its half of the fault injection.
    "reference/features/recovery.py": [_EDGES, "tests/test_fault_injection.py", "-k", "reference"],
    "reference/features/retention.py": _RETENTION,
    "reference/features/retention_rules.py": _RETENTION,
    "reference/features/ring.py": _KERNEL_FEATURES,
    "reference/features/rswa.py": _KERNEL_FEATURES,
    "reference/features/sparse_retention.py": _RETENTION,
}

_COMPARE_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BINOP_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}


@dataclass(frozen=True)
class Mutant:
    path: str
    index: int          # position among the file's mutation points (ast.walk order)
    line: int
    kind: str
    before: str
    after: str


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _mutations(node: ast.AST) -> list[tuple[str, ast.AST, ast.AST]]:
    """(kind, node replaced, replacement) for one node (possibly none)."""
    out: list[tuple[str, ast.AST, ast.AST]] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SWAP:
        compare = copy.deepcopy(node)
        compare.ops = [_COMPARE_SWAP[type(node.ops[0])]()]
        out.append(("compare", node, compare))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
        binop = copy.deepcopy(node)
        binop.op = _BINOP_SWAP[type(node.op)]()
        out.append(("arithmetic", node, binop))
    elif isinstance(node, ast.BoolOp):
        boolop = copy.deepcopy(node)
        boolop.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append(("boolean", node, boolop))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("drop-not", node, copy.deepcopy(node.operand)))
    elif (isinstance(node, ast.Constant) and type(node.value) is int) and node.value < 1 << 16:
        out.append(("constant", node, ast.Constant(node.value + 1)))
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        out.append(("constant", node, ast.Constant(not node.value)))
    elif isinstance(node, (ast.If, ast.While)):
        out.append(("negate-condition", node.test, ast.UnaryOp(ast.Not(), copy.deepcopy(node.test))))
    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Expr, ast.Return, ast.Raise)) and not _is_docstring(node):
        out.append(("delete-statement", node, ast.Pass()))
    return out


def mutation_points(path: Path) -> list[tuple[ast.AST, str, ast.AST]]:
    """(node replaced, kind, replacement) for every mutation of the file."""
    tree = ast.parse(path.read_text())
    points: list[tuple[ast.AST, str, ast.AST]] = []
    skip: set[int] = set()
    for node in ast.walk(tree):
        # Never mutate type annotations, __all__ or the module's imports.
        if isinstance(node, (ast.AnnAssign, ast.arg, ast.Import, ast.ImportFrom)):
            for child in ast.walk(node):
                skip.add(id(child))
            continue
        if isinstance(node, ast.FunctionDef) and node.returns is not None:
            for child in ast.walk(node.returns):
                skip.add(id(child))
        # __all__ and __slots__ change no behaviour a test can see.
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("__all__", "__slots__")
                                                for t in node.targets):
            for child in ast.walk(node):
                skip.add(id(child))
        if id(node) in skip or not hasattr(node, "end_lineno"):
            continue
        for kind, target, replacement in _mutations(node):
            points.append((target, kind, replacement))
    return points


def _segment_patch(source: str, node: Any, replacement: ast.AST) -> str:
    """``source`` with ``node``'s segment replaced by ``replacement``."""
    lines = source.splitlines(keepends=True)
    start: int = sum(len(line) for line in lines[:node.lineno - 1]) + len(
        lines[node.lineno - 1].encode()[:node.col_offset].decode())
    end_line = node.end_lineno or node.lineno
    end: int = sum(len(line) for line in lines[:end_line - 1]) + len(
        lines[end_line - 1].encode()[:node.end_col_offset or 0].decode())
    text = ast.unparse(replacement)
    if not isinstance(node, ast.stmt):
        text = f"({text})"
    return source[:start] + text + source[end:]


def enumerate_mutants(files: list[Path]) -> dict[str, list[Mutant]]:
    result: dict[str, list[Mutant]] = {}
    for path in files:
        source = path.read_text()
        rel = str(path.relative_to(ROOT))
        mutants = []
        for index, (node, kind, replacement) in enumerate(mutation_points(path)):
            before = ast.get_source_segment(source, node) or ""
            mutants.append(Mutant(rel, index, getattr(node, "lineno", 0), kind, before.splitlines()[0][:100],
                                  ast.unparse(replacement).splitlines()[0][:100]))
        result[rel] = mutants
    return result


def changed_lines(revision: str, rel: str) -> set[int]:
    """Line numbers of ``rel`` (in the working tree) added or changed since
    git ``revision``: the new side of ``git diff -U0``'s hunks."""
    diff = subprocess.run(["git", "diff", "-U0", revision, "--", rel], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    lines: set[int] = set()
    for header in diff.splitlines():
        if header.startswith("@@"):
            new = header.split()[2]          # +start[,count]
            start, _, count = new[1:].partition(",")
            lines.update(range(int(start), int(start) + (int(count) if count else 1)))
    return lines


def apply(mutant: Mutant) -> str:
    """The mutated source of the mutant's file (the file itself untouched)."""
    path = ROOT / mutant.path
    source = path.read_text()
    node, _, replacement = mutation_points(path)[mutant.index]
    mutated = _segment_patch(source, node, replacement)
    ast.parse(mutated)  # a mutant must still be valid Python
    return mutated


def forget_bytecode(rel: str) -> None:
    """Delete the cached bytecode of one module, wherever the install put it."""
    stem = Path(rel).stem
    for pyc in [*ROOT.glob(f"{Path(rel).parent}/__pycache__/{stem}.*.pyc"),
                *ROOT.glob(f"build/*/pagedkv/{Path(rel).parent}/__pycache__/{stem}.*.pyc")]:
        pyc.unlink(missing_ok=True)


def run_tests(tests: list[str], timeout: float) -> str:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               HYPOTHESIS_PROFILE=os.environ.get("MUTATION_PROFILE", "mutation"))
    env.pop("CI", None)
    try:
        completed = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                   cwd=ROOT, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "killed (timeout)"
    if completed.returncode == 0:
        return "survived"
    if completed.returncode in (1,):
        return "killed"
    return f"error (pytest rc {completed.returncode})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", type=int, default=6, help="mutants drawn per file")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--files", nargs="*", default=list(TARGETS))
    parser.add_argument("--out", default="tools/mutation_results.json")
    parser.add_argument("--list", action="store_true", help="only count the mutation points")
    parser.add_argument("--tests", nargs="*", default=TESTS,
                        help="the pytest arguments each mutant runs (default: the kernel's suite)")
    parser.add_argument("--changed-since", metavar="REV", default=None,
                        help="only mutants on lines changed since git revision REV")
    parser.add_argument("--features", action="store_true",
                        help="the reference's feature modules, each mutant with its module's FEATURE_TESTS")
    args = parser.parse_args()
    if args.features:
        args.files = list(FEATURE_TESTS)
    files = sorted({p for pattern in args.files for p in ROOT.glob(pattern)
                    if not any(fnmatch.fnmatch(str(p.relative_to(ROOT)), s) for s in SKIP)})
    everything = enumerate_mutants(files)
    if args.changed_since is not None:
        for rel, mutants in everything.items():
            lines = changed_lines(args.changed_since, rel)
            everything[rel] = [mutant for mutant in mutants if mutant.line in lines]
    if args.list:
        for rel, mutants in everything.items():
            print(f"{rel:34s} {len(mutants):5d} mutation points")
        return 0
    rng = random.Random(args.seed)
    chosen = [m for rel in sorted(everything) for m in sorted(
        rng.sample(everything[rel], min(args.per_file, len(everything[rel]))), key=lambda m: m.index)]
    def suite(mutant: Mutant) -> tuple[str, ...]:
        return tuple(FEATURE_TESTS[mutant.path] if args.features else args.tests)

    timeouts: dict[tuple[str, ...], float] = {}
    for tests in dict.fromkeys(map(suite, chosen)):
        started = time.monotonic()
        if run_tests(list(tests), 1800) != "survived":
            print(f"the unmutated tests fail ({' '.join(tests)}): fix them first", file=sys.stderr)
            return 2
        baseline = time.monotonic() - started
        timeouts[tests] = max(60.0, baseline * 3)
        print(f"baseline {baseline:.0f} s: {' '.join(tests)}", flush=True)
    print(f"{len(chosen)} mutants of {sum(map(len, everything.values()))} points", flush=True)
    results = []
    for number, mutant in enumerate(chosen, 1):
        path = ROOT / mutant.path
        original = path.read_text()
        try:
            path.write_text(apply(mutant))
            forget_bytecode(mutant.path)
            outcome = run_tests(list(suite(mutant)), timeouts[suite(mutant)])
        except SyntaxError:
            outcome = "invalid"
        finally:
            path.write_text(original)
            forget_bytecode(mutant.path)
        results.append(dict(asdict(mutant), outcome=outcome))
        print(f"[{number}/{len(chosen)}] {outcome:16s} {mutant.path}:{mutant.line} {mutant.kind}: "
              f"{mutant.before!r} -> {mutant.after!r}", flush=True)
    scores: dict[str, list[int]] = {}
    for result in results:
        if result["outcome"] == "invalid":
            continue
        entry = scores.setdefault(str(result["path"]), [0, 0])
        entry[0] += str(result["outcome"]).startswith("killed")
        entry[1] += 1
    print("\nper file: killed / tried")
    for rel, (killed, tried) in sorted(scores.items()):
        print(f"  {rel:44s} {killed:3d} / {tried:3d}  {100 * killed / tried:5.1f}%")
    killed = sum(k for k, _ in scores.values())
    tried = sum(t for _, t in scores.values())
    print(f"  {'total':44s} {killed:3d} / {tried:3d}  {100 * killed / max(tried, 1):5.1f}%")
    Path(ROOT / args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
