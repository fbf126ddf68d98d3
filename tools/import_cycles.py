"""Import cycles among pagedkv's modules, counting every import: type-only ones (under
``if TYPE_CHECKING:``) and those inside functions (grimp reads both by default).

``python tools/import_cycles.py [PACKAGE ...]`` prints each circle (a strongly connected
component of the import graph with more than one module) and exits 1 if there is one.
``make lint`` runs it over ``pagedkv``; import-linter's layers contracts (pyproject.toml)
forbid the upward imports that would close one between layers, this finds those inside a layer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import grimp


def circles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of ``graph`` restricted to ``modules`` (Tarjan's
    algorithm, iterative), those of two or more modules, each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in modules}
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if child < len(edges[node]):
                work.append((node, child + 1))
                nxt = edges[node][child]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=len, reverse=True)


def drop_extension_imports(graph: grimp.ImportGraph) -> None:
    """Remove the edges grimp draws for ``from . import _native`` (a compiled C module,
    which it cannot see) to the package itself: the C modules import nothing of pagedkv.
    An edge goes only if every name on its line is such a module (a ``.pyi`` stub beside
    it and no ``.py`` file)."""
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if not importer.startswith(imported + "."):
                continue
            spec = importlib.util.find_spec(imported)
            folder = Path(spec.origin).parent if spec and spec.origin else None
            lines = [d["line_contents"] for d in graph.get_import_details(importer=importer, imported=imported)]
            names = [name.strip().split(" as ")[0] for line in lines if " import " in line
                     for name in line.split(" import ", 1)[1].split(",")]
            if folder and names and all(f"{imported}.{name}" not in graph.modules
                                        and (folder / f"{name}.pyi").exists() for name in names):
                graph.remove_import(importer=importer, imported=imported)


def main(argv: list[str]) -> int:
    packages = argv or ["pagedkv"]
    # Type-only imports count: a circle through them still ties the modules together for a reader.
    graph = grimp.build_graph(*{package.split(".")[0] for package in packages},
                              exclude_type_checking_imports=False, cache_dir=None)
    drop_extension_imports(graph)
    modules = {m for m in graph.modules if any(m == p or m.startswith(p + ".") for p in packages)}
    found = circles(graph, modules)
    for circle in found:
        print(f"import cycle of {len(circle)} modules: {', '.join(circle)}")
    print(f"{len(found)} import cycle(s) in {', '.join(packages)} ({len(modules)} modules, "
          "type-only imports and imports inside functions counted)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
