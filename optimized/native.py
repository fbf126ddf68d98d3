"""Which build of the pool's per-block loops runs: the optional C module or
the Python loops in :mod:`.block_pool` (D-PERF-26).

``optimized/_native.c`` is compiled when the package is installed and a C
compiler is present (``setup.py``, ``optional=True``); without one the
package still installs and runs the Python loops, which stay the
definition: each C function is one of those loops, step for step, and hands
back ``None`` (nothing changed) for anything outside what the pool stores,
so the caller runs the Python loop on it. Setting the environment variable
``PAGEDKV_PURE_PYTHON=1`` before import selects the Python loops even when
the module is built (``make verify`` runs the lockstep tests both ways).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol

from pagedkv.spec.types import BlockHash

__all__ = ["NATIVE", "NativeLoops", "build_name"]


class NativeLoops(Protocol):
    """What ``optimized/_native.c`` provides (its docstrings say what each loop does)."""

    def release(self, ref: list[int], gids: list[int], prev: list[int], next: list[int], sentinel: int,
                blocks: list[int], /) -> int | None: ...

    def touch(self, ref: list[int], prev: list[int], next: list[int], blocks: list[int], /) -> int | None: ...

    def take(self, ref: list[int], hashes: Sequence[object] | None, prev: list[int], next: list[int],
             sentinel: int, n: int, evict: Callable[[int], object], /) -> list[int] | None: ...

    def key_run(self, hashes: list[BlockHash | None], gids: list[int], key_tokens: list[int], run: list[int],
                keys: list[BlockHash], group_id: int, first_count: int, step: int, /) -> bool | None: ...


def _load() -> NativeLoops | None:
    if os.environ.get("PAGEDKV_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from . import _native
    except ImportError:  # built without a C compiler
        return None
    return _native


NATIVE = _load()
"""The C module, or None when the Python loops run."""


def build_name() -> str:
    """``"native"`` or ``"pure-python"``: what the pool's loops run on (for bench output and bug reports)."""
    return "pure-python" if NATIVE is None else "native"
