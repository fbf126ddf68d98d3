"""Every invariant ID of spec/state.md is checked somewhere.

An ID is *checked by code* when a checker of ``reference/`` or ``optimized/``
raises an ``InvariantViolation`` under it (its message starts with the ID: the
string ``"<ID>"`` appears as a literal passed to a failure), and *checked by a
test* when a test module of ``tests/`` names it. A new ID in the spec with
neither fails here, as does a checker or test naming an ID the spec lacks.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ID = r"[A-Z]+(?:-[A-Z]+)?-\d+"


def spec_ids() -> set[str]:
    """The IDs defined in spec/state.md's invariant tables (first column)."""
    text = (ROOT / "spec" / "state.md").read_text()
    return set(re.findall(rf"^\| ({ID}) \|", text, flags=re.MULTILINE))


def raised_ids(*folders: str) -> set[str]:
    """IDs a checker raises: a string literal starting with ``"<ID>:"`` or
    passed whole as the first argument of a failure helper."""
    found: set[str] = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            found.update(re.findall(rf"""["'f]({ID}): """, text))
            found.update(re.findall(rf"""(?:_fail|fail)\(\s*["']({ID})["']""", text))
    return found


def named_ids(exclude: str = "test_spec_ids.py") -> set[str]:
    """IDs the test modules name (this module excepted)."""
    found: set[str] = set()
    for path in (ROOT / "tests").glob("*.py"):
        if path.name != exclude:
            found.update(re.findall(ID, path.read_text()))
    return found


def test_state_md_defines_ids() -> None:
    ids = spec_ids()
    assert {"POOL-1", "REQ-1", "HASH-1"} <= ids, sorted(ids)


def test_every_id_is_checked_by_code_or_a_test() -> None:
    unchecked = spec_ids() - raised_ids("reference", "optimized") - named_ids()
    assert not unchecked, f"IDs of spec/state.md that no checker raises and no test names: {sorted(unchecked)}"


def test_every_id_checked_by_the_reference_is_checked_by_optimized() -> None:
    spec = spec_ids()
    reference, optimized = raised_ids("reference") & spec, raised_ids("optimized") & spec
    assert reference <= optimized, f"checked by the reference only: {sorted(reference - optimized)}"


def test_checkers_raise_only_ids_of_the_spec() -> None:
    """A checker's ID that spec/state.md does not define is a typo or a stale ID."""
    invariant_like = {found for found in raised_ids("reference", "optimized")
                      if found.split("-")[0] in {"POOL", "CACHE", "EVT", "REQ", "HASH", "SKIP", "SINK", "MAMBA",
                                                 "XATTN", "SWA", "CHUNK", "HYB"}}
    assert invariant_like <= spec_ids(), sorted(invariant_like - spec_ids())
