"""No behaviour shared by the two implementations (spec/README.md, "What may live in pagedkv.spec").

A rule imported by both ``pagedkv.reference`` and ``pagedkv.optimized`` is run
identically on both sides, so the lockstep machines cannot see a mistake in
it. This test reads every module of ``reference/`` and ``optimized/`` (their
``import`` statements, statically, by AST), lists the ``pagedkv.spec``
modules both sides import, and fails on any that is not declared vocabulary
below. A rule that decides a hit, a block, a checkpoint, a copy or an event
belongs in a reference feature module and an optimized module, not here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The declared vocabulary of pagedkv.spec, with why each module may be shared:
# types, KV cache specs, configuration, the request view, events, errors,
# Protocols, the normative hash functions and argument checks that only refuse.
VOCABULARY: dict[str, str] = {
    "__init__": "the package's re-exports",
    "allocate_args": "argument checks of allocate_slots that only refuse",
    "attention_variants": "KV cache specs of the attention variants",
    "capacity": "configuration: what fits in a memory budget",
    "config": "configuration: KVCacheConfig and its groups",
    "errors": "the typed errors",
    "hashing": "the normative hash functions (spec/hashing.md)",
    "hisparse": "host-tier specs, configuration and records (transfers, events, snapshots)",
    "host_plan": "configuration: planning a host tier",
    "kv_cache_spec": "KV cache specs",
    "mamba_spec": "the Mamba KV cache spec",
    "manager_args": "argument checks of the manager's constructor that only refuse",
    "metrics": "the engine-facing hit-rate counter type (observes stats, decides nothing)",
    "planner": "configuration: the KV cache planner (CFG rules, one implementation)",
    "protocols": "Protocols",
    "registry": "configuration: which manager kind serves a spec type",
    "request": "the request view and a ready-made request",
    "retention": "retention directive types, policy names and argument checks that only refuse",
    "retention_config": "the opt-in retention configuration a manager is built with, and checks that only refuse",
    "setting": "configuration: the model setting",
    "sizing": "configuration arithmetic (CFG rules, one implementation)",
    "snapshot": "types: read-only snapshots",
    "stored_events": "configuration: the BlockStored shape option and its check that only refuses",
    "types": "types and events",
    "uniform_spec": "KV cache specs: the uniform-type merge",
}


def spec_modules_imported(root: Path, spec_names: frozenset[str] | None = None) -> dict[str, set[str]]:
    """``{spec module: {importing files}}`` for every ``.py`` file under
    ``root``: ``import pagedkv.spec.m``, ``from pagedkv.spec.m import ...``
    and ``from pagedkv.spec import m`` (``m`` a module of ``spec/``); a name
    taken from the package itself counts as ``__init__``."""
    if spec_names is None:
        spec_names = frozenset(path.stem for path in (ROOT / "spec").glob("*.py"))
    found: dict[str, set[str]] = {}

    def add(module: str, path: Path) -> None:
        found.setdefault(module, set()).add(str(path.relative_to(root.parent)))

    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                if node.module.startswith("pagedkv.spec."):
                    add(node.module.split(".")[2], path)
                elif node.module == "pagedkv.spec":
                    for alias in node.names:
                        add(alias.name if alias.name in spec_names else "__init__", path)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("pagedkv.spec."):
                        add(alias.name.split(".")[2], path)
    return found


def shared_rule_modules(reference: Path, optimized: Path,
                        spec_names: frozenset[str] | None = None) -> dict[str, list[str]]:
    """The ``pagedkv.spec`` modules both trees import that are not declared
    vocabulary, each with the files that import it."""
    ref, opt = spec_modules_imported(reference, spec_names), spec_modules_imported(optimized, spec_names)
    return {module: sorted(ref[module] | opt[module]) for module in sorted(set(ref) & set(opt))
            if module not in VOCABULARY}


def test_both_implementations_share_only_vocabulary() -> None:
    shared = shared_rule_modules(ROOT / "reference", ROOT / "optimized")
    assert not shared, ("pagedkv.spec modules imported by both implementations that are not declared "
                        f"vocabulary (write the rule twice, or declare it in VOCABULARY with why): {shared}")


def test_every_spec_module_is_declared() -> None:
    """A new ``spec/*.py`` module says what vocabulary it is before it lands."""
    undeclared = sorted(path.stem for path in (ROOT / "spec").glob("*.py") if path.stem not in VOCABULARY)
    assert not undeclared, f"spec modules missing from VOCABULARY: {undeclared}"


def test_the_scan_sees_a_shared_rule(tmp_path: Path) -> None:
    """The check's teeth: a rule module imported by both trees, in each of the
    three import forms, is reported; one imported by one side is not."""
    reference, optimized = tmp_path / "reference", tmp_path / "optimized"
    (reference / "features").mkdir(parents=True)
    optimized.mkdir()
    (reference / "features" / "eagle.py").write_text("from pagedkv.spec.eagle_rule import peek\n")
    (optimized / "eagle.py").write_text("def f() -> None:\n    import pagedkv.spec.eagle_rule\n")
    (optimized / "dcp.py").write_text("from pagedkv.spec import errors, tail_rule\n")
    (reference / "dcp.py").write_text("from pagedkv.spec.tail_rule import tail\nfrom pagedkv.spec.errors import E\n")
    (reference / "only.py").write_text("from pagedkv.spec.lonely_rule import x\n")
    shared = shared_rule_modules(reference, optimized, frozenset({"eagle_rule", "tail_rule", "errors"}))
    assert shared == {"eagle_rule": ["optimized/eagle.py", "reference/features/eagle.py"],
                      "tail_rule": ["optimized/dcp.py", "reference/dcp.py"]}
