"""The import rules of ``pagedkv.optimized`` that import-linter does not state
(docs/architecture.md, "Layers"): no import inside a function except of an optional
dependency, and no import circle, type-only imports and imports inside functions counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "optimized"


def imports_inside_functions(folder: Path) -> list[str]:
    """``path:line module`` of each import of a pagedkv module (by absolute or relative
    name) inside a function body under ``folder``. An optional dependency (torch, vllm,
    zmq, ...) is imported late on purpose; a module of our own never needs to be."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    names = [("." * node.level) + (node.module or "")]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                          if name.startswith((".", "pagedkv"))]
    return found


def test_no_module_of_the_core_is_imported_inside_a_function() -> None:
    assert imports_inside_functions(CORE) == []


def test_the_scan_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    """The scan itself can fail: a late import of our own is reported, torch's is not."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "m.py").write_text("def f():\n    import torch\n    from .block_pool import BlockPool\n",
                                 encoding="utf-8")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imports_inside_functions(folder) == ["pkg/m.py:3 .block_pool"]
    finally:
        ROOT = saved


def test_no_import_circle_in_the_optimized_package() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "import_cycles.py"), "pagedkv.optimized"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_engine_surface_is_exactly_what_the_vllm_adapter_imports() -> None:
    """``pagedkv.optimized.engine`` exports what ``pagedkv.vllm`` uses, no more: a name the
    adapter stops using leaves the surface (docs/vllm.md lists each with its contract)."""
    import pagedkv.optimized.engine as engine

    used: set[str] = set()
    for path in sorted((ROOT / "src" / "pagedkv" / "vllm").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "pagedkv.optimized.engine":
                used.update(alias.name for alias in node.names)
    assert used == set(engine.__all__)
