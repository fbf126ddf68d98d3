"""The ``pagedkv`` command line.

Subcommands:

``pagedkv demo [--requests N] [--hash-fn NAME] [--num-blocks N] [--no-reference]``
    The standard chat trace through the optimized manager with the reference
    in lockstep (``pagedkv.demo``); ``make demo`` runs it.
``pagedkv plan [ARGS...]``
    The KV cache planner (``pagedkv.plan.main``); its arguments pass through
    untouched.
``pagedkv simulate TRACE [ARGS...]``
    Replay a serving trace through real managers (``pagedkv.simulate.cli``);
    its arguments pass through untouched.

Also runnable as ``python -m pagedkv.cli``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _run_plan(argv: list[str]) -> int:
    # Imported lazily: the planner is a separate module and may be absent or
    # heavier to import than the demo needs.
    try:
        plan: Any = importlib.import_module("pagedkv.plan")
    except ModuleNotFoundError as error:
        if error.name != "pagedkv.plan":
            raise
        print("pagedkv plan: the planner (pagedkv.plan) is not installed in this build",
              file=sys.stderr)
        return 2
    status = plan.main(argv)
    return 0 if status is None else int(status)


def _parser() -> argparse.ArgumentParser:
    from pagedkv import demo

    parser = argparse.ArgumentParser(
        prog="pagedkv", description="pagedkv: a verified KV-cache block manager for LLM serving engines.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo_parser = commands.add_parser("demo", help="the standard chat trace, optimized vs reference in lockstep",
                                      description=demo.DESCRIPTION)
    demo.add_arguments(demo_parser)
    commands.add_parser("plan", help="plan a KV cache configuration (arguments go to pagedkv.plan)",
                        add_help=False)
    commands.add_parser("simulate", help="replay a serving trace: hit rate per capacity, routing "
                        "(arguments go to pagedkv.simulate.cli)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pagedkv`` command line with ``argv`` (default ``sys.argv[1:]``);
    return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "plan":  # everything after "plan" is the planner's
        return _run_plan(args[1:])
    if args and args[0] == "simulate":  # likewise the simulator's
        from pagedkv.simulate.cli import main as simulate

        return simulate(args[1:])
    parsed = _parser().parse_args(args)
    if parsed.command == "demo":
        from pagedkv import demo

        return demo.run(parsed)
    raise AssertionError(f"unhandled command {parsed.command!r}")  # argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
