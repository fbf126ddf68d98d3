"""The CrossHair gate of ``make crosshair``.

Runs ``crosshair check`` over every module listed in
``tests/crosshair_targets.txt`` (one dotted module name per line, ``#``
comments allowed) and fails on any counterexample. It first runs the planted
bug in ``tests/crosshair_fixtures/planted_bug.py`` and fails unless CrossHair
reports it: CrossHair exits 0 when it merely cannot confirm a contract, so
the gate reads the ``--report_all`` output instead of trusting the exit code.

Each postcondition ends in one of three states: *proved* ("Confirmed over all
paths"), *not confirmed* (explored until the per-condition budget ran out
without a counterexample: evidence, not proof) or *refuted* (a
counterexample: the gate fails). The gate lists every postcondition it could
not confirm, with its file and line relative to the repository and the
condition's text, so a reader sees what is proved and what is only tested.

``CROSSHAIR_PER_CONDITION_TIMEOUT`` (CPU seconds, default 4) sets the budget
of each condition.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TIMEOUT_PER_CONDITION = os.environ.get("CROSSHAIR_PER_CONDITION_TIMEOUT", "4")
# "<file>:<line>: <severity>: <message>", CrossHair's machine-readable report line.
REPORT_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<severity>error|info|warning): (?P<message>.*)$")


@dataclass(frozen=True)
class Finding:
    """One line of CrossHair's report, its file made relative to the repository."""

    file: str
    line: int
    severity: str
    message: str

    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def condition(self) -> str:
        """The source line CrossHair points at (a ``post:`` line), and the
        function it belongs to; empty when the file cannot be read."""
        path = ROOT / self.file
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return ""
        text = lines[self.line - 1].strip() if 0 < self.line <= len(lines) else ""
        for previous in reversed(lines[:self.line]):
            stripped = previous.lstrip()
            if stripped.startswith(("def ", "async def ")):
                name = stripped.split("def ", 1)[1].split("(", 1)[0]
                return f"{name}: {text}"
        return text


def relative(file: str) -> str:
    """``file`` relative to the repository root. The strict editable install
    links each module from ``build/__editable__*/``; resolving the link gives
    the checkout's own file."""
    resolved = Path(file).resolve()
    try:
        return str(resolved.relative_to(ROOT))
    except ValueError:
        return file


def crosshair(target: str) -> tuple[list[Finding], list[str], float]:
    """(report lines, problems, seconds) for one target. A problem is a
    counterexample or CrossHair failing without a report."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "crosshair", "check", "--report_all",
         "--per_condition_timeout", TIMEOUT_PER_CONDITION, target],
        capture_output=True, text=True, cwd=ROOT,
    )
    elapsed = time.monotonic() - started
    findings: list[Finding] = []
    other: list[str] = []
    for raw in proc.stdout.splitlines() + proc.stderr.splitlines():
        match = REPORT_LINE.match(raw.strip())
        if match:
            findings.append(Finding(relative(match["file"]), int(match["line"]),
                                    match["severity"], match["message"]))
        elif raw.strip():
            other.append(raw)
    problems = [f"{f.where()}: {f.message}" for f in findings if f.severity == "error"]
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not problems):
        problems.append(f"crosshair exited {proc.returncode} without a report:\n" + "\n".join(other[-20:]))
    return findings, problems, elapsed


def main() -> int:
    """Run the planted fixture, then every target; 0 only if all is as expected."""
    started = time.monotonic()
    planted = str(HERE / "crosshair_fixtures" / "planted_bug.py")
    _, caught, seconds = crosshair(planted)
    if not caught:
        print(f"FAIL: CrossHair did not catch the planted bug in {relative(planted)}: the gate cannot fail")
        return 1
    print(f"ok   planted bug caught in {seconds:.0f}s: {caught[0]}")

    targets = [line.split("#")[0].strip() for line in (HERE / "crosshair_targets.txt").read_text().splitlines()]
    failed = False
    unconfirmed: list[Finding] = []
    for target in filter(None, targets):
        findings, problems, seconds = crosshair(target)
        proved = [f for f in findings if f.message.startswith("Confirmed over all paths")]
        open_ = [f for f in findings if f.message.startswith("Not confirmed")]
        unconfirmed += open_
        if problems:
            failed = True
            print(f"FAIL {target} ({seconds:.0f}s):")
            print("\n".join(problems))
        else:
            print(f"ok   {target}: {len(proved)} conditions proved, {len(open_)} not confirmed "
                  f"(explored without counterexample) ({seconds:.0f}s)")
    if unconfirmed:
        print(f"\nNot confirmed: explored for {TIMEOUT_PER_CONDITION} CPU s each without a counterexample, "
              "but not proved:")
        for finding in unconfirmed:
            print(f"  {finding.where()}  {finding.condition()}")
    print(f"\ncrosshair gate: {'FAILED' if failed else 'passed'} in {time.monotonic() - started:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
