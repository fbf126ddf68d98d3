"""The CrossHair gate of ``make crosshair``.

Runs ``crosshair check`` over every module listed in
``tests/crosshair_targets.txt`` (one dotted module name per line, ``#``
comments allowed) and fails on any counterexample. It first runs the planted
bug in ``tests/crosshair_fixtures/planted_bug.py`` and fails unless CrossHair
reports it: CrossHair exits 0 when it merely cannot confirm a contract, so
the gate reads the ``--report_all`` output instead of trusting the exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT_PER_CONDITION = os.environ.get("CROSSHAIR_PER_CONDITION_TIMEOUT", "4")


def crosshair(target: str) -> tuple[list[str], list[str], float]:
    """(counterexample lines, all reported lines, seconds) for one target."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "crosshair", "check", "--report_all",
         "--per_condition_timeout", TIMEOUT_PER_CONDITION, target],
        capture_output=True, text=True, cwd=HERE.parent,
    )
    elapsed = time.monotonic() - started
    lines = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ": error:" in line]
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not errors):
        errors.append(f"crosshair exited {proc.returncode} without a report:\n" + "\n".join(lines[-20:]))
    return errors, lines, elapsed


def main() -> int:
    """Run the planted fixture, then every target; 0 only if all is as expected."""
    planted = str(HERE / "crosshair_fixtures" / "planted_bug.py")
    caught, _, seconds = crosshair(planted)
    if not caught:
        print(f"FAIL: CrossHair did not catch the planted bug in {planted}: the gate cannot fail")
        return 1
    print(f"ok   planted bug caught in {seconds:.0f}s: {caught[0].split(': error: ')[-1]}")

    targets = [line.split("#")[0].strip() for line in (HERE / "crosshair_targets.txt").read_text().splitlines()]
    failed = False
    for target in filter(None, targets):
        errors, lines, seconds = crosshair(target)
        confirmed = sum("Confirmed over all paths" in line for line in lines)
        explored = sum("Not confirmed" in line for line in lines)
        if errors:
            failed = True
            print(f"FAIL {target} ({seconds:.0f}s):")
            print("\n".join(errors))
        else:
            print(f"ok   {target}: {confirmed} conditions proved, {explored} explored "
                  f"without counterexample ({seconds:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
