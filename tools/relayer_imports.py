"""Rewrite imports and path mentions of ``pagedkv.optimized`` modules from the flat layout to
the layered packages (docs/architecture.md, "The optimized layout"; D-API-49).

``python tools/relayer_imports.py [FILE ...]`` (default: every tracked text file) rewrites
``pagedkv.optimized.<module>`` to ``pagedkv.optimized.<package>.<module>``, a relative
``from .<module> import`` inside ``optimized/`` to the absolute form, and
``optimized/<module>.py`` to ``optimized/<package>/<module>.py``. Idempotent: for work written
against the flat layout (a branch merged after the move), then ``ruff check --fix --select I``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PACKAGES = {
    "pool": ["free_queue", "pool_view", "block_pool", "pool_caching", "pool_events", "pool_recover",
             "blocks", "hit_memo", "hasher"],
    "rules": ["dcp_rules", "eagle_rules", "mamba_checkpoint_rules", "mamba_partial_rules", "connector_hits"],
    "groups": ["single_type", "windowed", "cross_attention", "ring", "rswa", "mamba", "mamba_partial",
               "mamba_publish", "dcp_partial", "eagle", "hybrid_search", "group_hits"],
    "paths": ["admit_path", "decode_path", "fill_path", "decode", "recovery", "capacity"],
    "coordination": ["coordinator", "coordinator_kinds", "coordinator_sub_block", "admission"],
    "host_tier": ["hisparse", "hisparse_rules", "hisparse_state", "hisparse_steps"],
}
"""Each package of pagedkv.optimized and the modules moved into it."""
TOP = ["manager", "manager_reads", "validation", "sub_block_ops", "native", "engine"]
"""Modules that stay at the top of pagedkv.optimized."""
WHERE = {module: package for package, modules in PACKAGES.items() for module in modules}
NAMES = "|".join(sorted(WHERE, key=len, reverse=True))
DOTTED = re.compile(r"pagedkv\.optimized\.(" + NAMES + r")\b")
SLASHED = re.compile(r"(?<![A-Za-z_/])optimized/(" + NAMES + r")\.py\b")
RELATIVE = re.compile(r"^(\s*)from \.(" + NAMES + r") import ", re.M)
RELATIVE_TOP = re.compile(r"^(\s*)from \.(" + "|".join(TOP) + r") import ", re.M)
RELATIVE_PACKAGE = re.compile(r"^(\s*)from \. import (\w+)$", re.M)
FROM_PACKAGE = re.compile(r"^(\s*)from pagedkv\.optimized import (" + NAMES + r")( as \w+)?$", re.M)
SUFFIXES = (".py", ".md", ".pyi", ".toml", ".cfg", ".txt", ".sh")


def rewrite(path: str, text: str) -> str:
    """``text`` of the file at ``path`` (relative to the repository) with the new names."""
    nested = path.startswith("optimized/") and path.count("/") == 2 and not path.startswith("optimized/tensor/")
    if path.startswith("optimized/") and path.endswith(".py") and not path.startswith("optimized/tensor/"):
        text = RELATIVE.sub(lambda m: f"{m.group(1)}from pagedkv.optimized.{WHERE[m.group(2)]}.{m.group(2)} import ",
                            text)
        if nested:  # `from .native import` in a sub-package means the top-level module
            text = RELATIVE_TOP.sub(r"\1from pagedkv.optimized.\2 import ", text)
            text = RELATIVE_PACKAGE.sub(
                lambda m: (f"{m.group(1)}from pagedkv.optimized.{WHERE[m.group(2)]} import {m.group(2)}"
                           if m.group(2) in WHERE else
                           f"{m.group(1)}from pagedkv.optimized import {m.group(2)}" if m.group(2) in TOP
                           else m.group(0)), text)
    text = FROM_PACKAGE.sub(
        lambda m: f"{m.group(1)}from pagedkv.optimized.{WHERE[m.group(2)]} import {m.group(2)}{m.group(3) or ''}",
        text)
    text = DOTTED.sub(lambda m: f"pagedkv.optimized.{WHERE[m.group(1)]}.{m.group(1)}", text)
    return SLASHED.sub(lambda m: f"optimized/{WHERE[m.group(1)]}/{m.group(1)}.py", text)


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    files = argv or subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                                   check=True).stdout.split()
    for name in files:
        path = root / name
        if not (name.endswith(SUFFIXES) or path.name == "Makefile") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        new = rewrite(str(path.relative_to(root)), text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print("rewrote", name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
