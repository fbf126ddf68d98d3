"""spec/invariants.md is the catalogue of every rule ID, and it stays true.

Read over every spec file, the code and the tests:

- every ID a spec file defines (a bold ``**ID`` or a table's first column)
  is a catalogue row, and every row's ID is stated in the spec files its
  "stated in" column names;
- an ID-shaped name of a catalogued family that no row lists (a typo, a
  stale ID) fails, in the spec files and in the checkers' messages;
- a rule with two implementations is named in ``reference/`` and in
  ``optimized/`` (Python or C: a checker message or a comment beside the
  code keeping it); the planner's CFG IDs, written once, in ``pagedkv.spec``;
- every ID is named by a test; every step ID is cited in ``reference/``,
  ``optimized/`` and ``tests/``;
- a row that says *ci* names an implementation whose checker raises the ID,
  and every ``file::function`` the catalogue names exists.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec"
CATALOGUE = SPEC / "invariants.md"
ID = r"[A-Z][A-Z0-9]*(?:-[A-Z]+)?-\d+[a-z]?"
STEP_FAMILIES = {"ALLOC", "LOOKUP", "FREE", "EVICT", "RESET"}


@cache
def _ids_in(text: str) -> frozenset[str]:
    """The whole IDs ``text`` names (``HOST-10`` does not name ``HOST-1``,
    nor does the decision ``D-HOST-1``)."""
    return frozenset(re.findall(rf"(?<![\w-])({ID})(?![\w])", text))


def _named(text: str, rule_id: str) -> bool:
    return rule_id in _ids_in(text)


def _family(rule_id: str) -> str:
    return rule_id.rsplit("-", 1)[0]


@cache
def rows() -> dict[str, list[str]]:
    """The catalogue: ID -> its row's cells (the ID first)."""
    found: dict[str, list[str]] = {}
    for line in CATALOGUE.read_text().splitlines():
        match = re.match(rf"^\| ({ID}) \|", line)
        if match:
            assert match.group(1) not in found, f"{match.group(1)} has two catalogue rows"
            found[match.group(1)] = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
    return found


def spec_files() -> list[Path]:
    """Every spec file but the catalogue (decisions cite rule IDs, define none)."""
    return [path for path in sorted(SPEC.glob("*.md")) if path.name != CATALOGUE.name]


def defined_ids() -> dict[str, set[str]]:
    """ID -> the spec files that define it: a bold ``**ID`` or a table row's first cell."""
    found: dict[str, set[str]] = {}
    for path in spec_files():
        text = path.read_text()
        for rule_id in re.findall(rf"\*\*({ID})\b", text) + re.findall(rf"^\| ({ID}) \|", text, re.MULTILINE):
            if not rule_id.startswith("D-"):
                found.setdefault(rule_id, set()).add(path.name)
    return found


def _texts(folder: str, *patterns: str) -> str:
    return "\n".join(path.read_text() for pattern in patterns for path in sorted((ROOT / folder).rglob(pattern)))


@cache
def reference_text() -> str:
    return _texts("reference", "*.py")


@cache
def optimized_text() -> str:
    return _texts("optimized", "*.py", "*.c", "*.h")


@cache
def vocabulary_text() -> str:
    return _texts("spec", "*.py")


@cache
def suite_text() -> str:
    """Every test module but this one (which names IDs only to check them)."""
    modules = sorted((ROOT / "tests").glob("*.py"))
    return "\n".join(path.read_text() for path in modules if path.name != Path(__file__).name)


@cache
def raised_ids(folder: str) -> set[str]:
    """IDs a checker in ``folder`` raises: a string literal starting with
    ``"<ID>: "`` or passed whole as the first argument of a failure helper."""
    found: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        text = path.read_text()
        found.update(re.findall(rf"""["'f]({ID}): """, text))
        found.update(re.findall(rf"""(?:_fail|fail)\(\s*["']({ID})["']""", text))
        # One of two IDs chosen at the failure: ``"HOST-2" if ... else "HOST-3"``.
        found.update(re.findall(rf"""["']({ID})["'] if """, text))
        found.update(re.findall(rf"""["']{ID}["'] if [^\n]* else ["']({ID})["']""", text))
    return found


def test_the_catalogue_has_every_kind_of_row() -> None:
    families = {_family(rule_id) for rule_id in rows()}
    assert {"POOL", "REQ", "MPART", "HOST", "CFG"} | STEP_FAMILIES <= families, sorted(families)


def test_every_id_a_spec_file_defines_is_catalogued() -> None:
    missing = {rule_id: sorted(files) for rule_id, files in defined_ids().items() if rule_id not in rows()}
    assert not missing, f"IDs defined in spec/ but missing from spec/invariants.md: {missing}"


def test_every_catalogued_id_is_stated_where_its_row_says() -> None:
    defined = defined_ids()
    wrong: list[str] = []
    for rule_id, cells in rows().items():
        if rule_id not in defined:
            wrong.append(f"{rule_id}: no spec file defines it")
            continue
        # Step rows have no "stated in" column: operations.md defines them.
        places = set(re.findall(r"[\w]+\.md", cells[2])) if _family(rule_id) not in STEP_FAMILIES else {
            "operations.md"}
        for place in places:
            if not _named((SPEC / place).read_text(), rule_id):
                wrong.append(f"{rule_id}: its row says {place}, which does not name it")
    assert not wrong, wrong


def test_no_spec_file_names_an_uncatalogued_id_of_a_catalogued_family() -> None:
    families = {_family(rule_id) for rule_id in rows()}
    stray = {(path.name, rule_id) for path in spec_files() + [CATALOGUE]
             for rule_id in re.findall(rf"(?<![\w-])({ID})(?![\w])", path.read_text())
             if _family(rule_id) in families and rule_id not in rows()}
    assert not stray, f"IDs of a catalogued family that the catalogue lacks (typo or stale): {sorted(stray)}"


def test_checkers_raise_only_catalogued_ids() -> None:
    families = {_family(rule_id) for rule_id in rows()}
    stray = {rule_id for rule_id in raised_ids("reference") | raised_ids("optimized")
             if _family(rule_id) in families and rule_id not in rows()}
    assert not stray, f"a checker raises an ID the catalogue lacks: {sorted(stray)}"


def test_every_rule_with_two_implementations_is_named_in_both() -> None:
    missing = [f"{rule_id} ({side})" for rule_id in rows() if _family(rule_id) != "CFG"
               for side, text in (("reference", reference_text()), ("optimized", optimized_text()))
               if not _named(text, rule_id)]
    assert not missing, f"named nowhere in that implementation (cite it beside the code keeping it): {missing}"


def test_every_cfg_id_is_named_in_its_one_implementation() -> None:
    missing = [rule_id for rule_id in rows() if _family(rule_id) == "CFG" and not _named(vocabulary_text(), rule_id)]
    assert not missing, f"CFG IDs named nowhere in pagedkv.spec: {missing}"


def test_every_id_is_named_by_a_test() -> None:
    missing = [rule_id for rule_id in rows() if not _named(suite_text(), rule_id)]
    assert not missing, f"IDs no test names: {missing}"


def test_a_row_that_says_ci_names_a_checker_raising_the_id() -> None:
    """*ci* in a checker column: that implementation's checker raises the ID
    (or, for "ci (as X)", the ID X that stands for it)."""
    wrong: list[str] = []
    for rule_id, cells in rows().items():
        if _family(rule_id) in STEP_FAMILIES or _family(rule_id) == "CFG":
            continue
        for side, cell in (("reference", cells[3]), ("optimized", cells[4])):
            if not cell.startswith("ci"):
                continue
            alias = re.match(rf"ci \(as ({ID})\)", cell)
            raised = alias.group(1) if alias else rule_id
            if raised not in raised_ids(side):
                wrong.append(f"{rule_id}: the {side} column says ci but no {side} checker raises {raised}")
    assert not wrong, wrong


def test_every_checker_and_test_the_catalogue_names_exists() -> None:
    missing: list[str] = []
    for rule_id, cells in rows().items():
        for path, name in re.findall(r"`([\w/.]+\.(?:py|c))::(\w+)`", " | ".join(cells[1:])):
            file = ROOT / path if "/" in path else ROOT / "optimized" / path
            if not file.is_file():
                missing.append(f"{rule_id}: no file {path}")
            elif not re.search(rf"(?:def|class) {name}\b|^(?:[\w *]*\b)?{name}\(", file.read_text(), re.MULTILINE):
                missing.append(f"{rule_id}: {path} defines no {name}")
    assert not missing, "update spec/invariants.md after a move or rename: " + "; ".join(missing)


def test_step_ids_are_cited_in_reference_optimized_and_tests() -> None:
    steps = [rule_id for rule_id in rows() if _family(rule_id) in STEP_FAMILIES]
    assert len(steps) == 30, steps
    missing = [f"{rule_id} ({where})" for rule_id in steps
               for where, text in (("reference", reference_text()), ("optimized", optimized_text()),
                                   ("tests", suite_text()))
               if not _named(text, rule_id)]
    assert not missing, missing
