"""docs/architecture.md's table of C entry points is complete and true.

Every function the built C modules export has a row (C entry point, its
Python twin, the twin test); every twin test named there exists; and the
named structures the C steps read are the NamedTuples of ``native.py``, in
the order the C code reads them (a module whose order disagrees is refused
at import, as a stale build). Skipped, with the reason, in a build without a
C compiler.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pagedkv.optimized import native

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `(_native|_tokens|_decode)\.(\w+)` \| [^|]+ \| `(tests/[\w/]+\.py)::(\w+)` \|$")

needs_build = pytest.mark.skipif(native.build_name() != "native",
                                 reason="built without the C modules (no C compiler, or PAGEDKV_PURE_PYTHON=1)")


def _rows() -> list[tuple[str, str, str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return [(m[1], m[2], m[3], m[4]) for m in map(ROW.match, text.splitlines()) if m]


def _exported(module: object) -> set[str]:
    return {name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))}


@needs_build
def test_every_c_entry_point_has_a_row() -> None:
    modules: dict[str, object] = {"_native": native.NATIVE, "_tokens": native.TOKENS, "_decode": native.DECODE}
    listed = {(module, name) for module, name, _, _ in _rows()}
    built = {(label, name) for label, module in modules.items() for name in _exported(module)}
    assert built, "no C module loaded"
    assert listed == built, f"missing rows: {sorted(built - listed)}; rows of no export: {sorted(listed - built)}"


def test_every_twin_test_exists() -> None:
    rows = _rows()
    assert len(rows) >= 10
    for _, name, path, test in rows:
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {test}\(", source, re.MULTILINE), f"{name}: {path}::{test} is not a test"


@needs_build
def test_the_contexts_are_the_named_structures() -> None:
    assert native.NATIVE is not None and native.DECODE is not None
    pairs: list[tuple[object, str, Any]] = [
        (native.NATIVE, "ADMIT_FIELDS", native.AdmitContext), (native.NATIVE, "LOOKUP_FIELDS", native.LookupContext),
        (native.NATIVE, "RELEASE_FIELDS", native.ReleaseContext), (native.DECODE, "STEP_FIELDS", native.DecodeContext)]
    for module, name, structure in pairs:
        assert getattr(module, name) == structure._fields, name
    # A module whose order disagrees is refused as a stale build.
    stale = ModuleType("stale")
    stale.STEP_FIELDS = tuple(reversed(native.DecodeContext._fields))  # type: ignore[attr-defined]
    with pytest.raises(ImportError, match="stale build"):
        native._matches(stale, {"STEP_FIELDS": native.DecodeContext})
