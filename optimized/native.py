"""Which build runs: the optional C modules or the Python code they mirror.

Three modules, compiled when the package is installed and a C compiler is
present (``setup.py``):

- ``optimized/_native.c``: the block pool's per-block loops in
  :mod:`.block_pool` and :mod:`.pool_caching` (D-PERF-26), and, for one
  full-attention group, the lookup and the release around them (D-PERF-49);
- ``optimized/_tokens.c``: checking and packing a request's token ids
  (``spec.request.pack_token_ids``) and hashing a prompt's blocks with
  sha256 (:mod:`.hasher`, D-PERF-35);
- ``optimized/_decode.c``: the decode step's no-op test
  (:func:`.decode.is_noop_decode`, D-PERF-39), and that step's no-op case
  around it (:mod:`.decode_path`, D-PERF-50).

Without a compiler the package still installs and runs the Python code,
which stays the definition: each C function does what its Python
counterpart does and hands back ``None`` (nothing changed) for anything
outside what it covers, so the caller runs the Python code on it. Setting
the environment variable ``PAGEDKV_PURE_PYTHON=1`` before import selects
the Python code even when the modules are built (``make verify`` runs the
lockstep tests both ways).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pagedkv.spec.types import BlockHash

__all__ = ["DECODE", "NATIVE", "TOKENS", "DecodeContext", "LookupContext", "NativeDecode",
           "NativeLoops", "NativeTokens", "ReleaseContext", "build_name"]


# The named structures the C steps are bound to (functools.partial). C reads
# their items by position (a tuple subclass: no attribute lookup per call);
# each module's *_FIELDS tuple names its positions, and the fast paths check
# them against these classes when they bind (test_native_calls holds them equal).

class DecodeContext(NamedTuple):
    """What ``_decode.decode_step`` reads: the decode step's rules (``decode_path``)."""

    python_step: Callable[..., Any]
    rules: tuple[tuple[Any, ...], ...]
    counted: set[type]
    max_model_len: int
    caching: bool
    hash_block_size: int
    empty: Any


class LookupContext(NamedTuple):
    """What ``_native.lookup`` reads: the one group's map (``manager``)."""

    table: dict[bytes, int]
    block_size: int
    pool: Any
    blocks_type: type
    hashes: list[Any]


class ReleaseContext(NamedTuple):
    """What ``_native.release_request`` reads: the one group's tables (``coordinator_kinds``)."""

    python_release: Callable[[str], None]
    requests: set[str]
    blocks_of: dict[str, list[int]]
    cached_of: dict[str, int]
    ref: list[int]
    gids: list[int]
    prev: list[int]
    next: list[int]
    sentinel: int
    queue: Any
    free_held: Callable[[list[int]], None]


class NativeLoops(Protocol):
    """What ``optimized/_native.c`` provides (its docstrings say what each loop does)."""

    def release(self, ref: list[int], gids: list[int], prev: list[int], next: list[int], sentinel: int,
                blocks: list[int], /) -> int | None: ...

    def touch(self, ref: list[int], prev: list[int], next: list[int], blocks: list[int], /) -> int | None: ...

    def take(self, ref: list[int], hashes: Sequence[object] | None, prev: list[int], next: list[int],
             sentinel: int, n: int, evict: Callable[[int], object],
             maps: tuple[list[int], list[dict[bytes, int]], list[dict[bytes, list[int]]]]
             | tuple[list[int], list[dict[bytes, int]], list[dict[bytes, list[int]]], object] | None = None,
             /) -> list[int] | None: ...

    def key_run(self, hashes: list[BlockHash | None], gids: list[int], key_tokens: list[int], run: list[int],
                keys: list[BlockHash], group_id: int, first_count: int, step: int, /) -> bool | None: ...

    def map_run(self, table: dict[bytes, int], keys: list[bytes], run: list[int], /) -> bool | None: ...

    def prefix_hits(self, table: dict[bytes, int], hashes: Sequence[bytes], limit: int, owner: object = None,
                    /) -> list[int] | None: ...

    def same_prefix(self, items: Sequence[object], prefix: Sequence[object], /) -> bool | None: ...


    def admit(self, ref: list[int], prev: list[int], next: list[int], sentinel: int,
              hashes: list[BlockHash | None], gids: list[int], key_tokens: list[int], table: dict[bytes, int],
              evict: Callable[[int], object],
              maps: tuple[list[int], list[dict[bytes, int]], list[dict[bytes, list[int]]], object],
              blocks: list[int], missing: int, keys: Sequence[BlockHash], num_full: int, block_size: int,
              /) -> tuple[int, list[int] | None, bool | None] | None: ...

    def lookup(self, context: tuple[Any, ...], request: Any, /) -> tuple[Any, int] | None: ...

    def release_request(self, context: tuple[Any, ...], request_id: str, /) -> None: ...


class NativeTokens(Protocol):
    """What ``optimized/_tokens.c`` provides (its docstrings say what each function does)."""

    def pack(self, tokens: list[int], /) -> bytes | None: ...

    def sha256_blocks(self, packed: bytes, start: int, end: int, size: int, parent: bytes,
                      sha256: Callable[[bytes], Any], /) -> list[BlockHash] | None: ...


class NativeDecode(Protocol):
    """What ``optimized/_decode.c`` provides (its docstring says what it does)."""

    def noop(self, rules: tuple[tuple[Any, ...], ...], request_id: str, num_computed: int, total: int,
             cache_tokens: int, /) -> bool | None: ...

    def decode_step(self, context: tuple[Any, ...], request: Any, num_new_tokens: int,
                    delay_cache_blocks: bool, /) -> Any: ...


def _load(name: str) -> Any:
    """The built module ``pagedkv.optimized.<name>``, or None: built without
    a C compiler, or ``PAGEDKV_PURE_PYTHON`` set."""
    if os.environ.get("PAGEDKV_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:  # built without a C compiler
        return None


if TYPE_CHECKING:  # the stubs (_native.pyi, ...) must satisfy the Protocols above
    from . import _decode, _native, _tokens

    _protocols: tuple[NativeLoops, NativeTokens, NativeDecode] = (_native, _tokens, _decode)

def _matches(module: Any, fields: dict[str, Any]) -> Any:
    """``module``, after checking that each C step reads its context in the
    order of its NamedTuple's fields (a stale build otherwise: ``make install``)."""
    for name, structure in fields.items():
        if module is not None and getattr(module, name, None) != structure._fields:
            raise ImportError(f"{module.__name__}.{name} disagrees with {structure.__name__}: a stale build "
                              "(run make install)")
    return module


NATIVE: NativeLoops | None = _matches(_load("_native"), {
    "LOOKUP_FIELDS": LookupContext, "RELEASE_FIELDS": ReleaseContext})
"""The pool's C loops, or None when the Python loops run."""

TOKENS: NativeTokens | None = _load("_tokens")
"""Token checking and prompt hashing in C, or None when the Python code runs."""

DECODE: NativeDecode | None = _matches(_load("_decode"), {"STEP_FIELDS": DecodeContext})
"""The decode step's no-op test in C, or None when the Python test runs."""


def build_name() -> str:
    """``"native"`` or ``"pure-python"``: what the pool's loops, the token
    checks and the decode test run on (for bench output and bug reports);
    ``"partial"`` if only some of the modules loaded (a stale build: ``make
    install``)."""
    loaded = [module is not None for module in (NATIVE, TOKENS, DECODE)]
    if not any(loaded):
        return "pure-python"
    return "native" if all(loaded) else "partial"
