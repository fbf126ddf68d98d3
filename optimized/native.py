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

__all__ = ["DECODE", "NATIVE", "TOKENS", "AdmitContext", "DecodeContext", "LookupContext", "NativeDecode",
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


class AdmitContext(NamedTuple):
    """What ``_native.admit`` reads: the pool's lists and the one group's map (``admit_path``)."""

    ref: list[int]
    prev: list[int]
    next: list[int]
    sentinel: int
    hashes: list[BlockHash | None]
    gids: list[int]
    key_tokens: list[int]
    table: dict[bytes, int]
    evict: Callable[[int], object]
    maps: tuple[list[int], list[dict[bytes, int]], list[dict[bytes, list[int]]], object]
    block_size: int


# The documentation of the C functions: each C function's docstring is its
# signature, and what it does, answers and declines is said here. Every
# function either does exactly what its Python twin does or answers None
# having changed nothing (docs/architecture.md pairs them, with the test that
# compares them).

class NativeLoops(Protocol):
    """What ``optimized/_native.c`` (and its ``_native_*.c`` parts) provides."""

    def release(self, ref: list[int], gids: list[int], prev: list[int], next: list[int], sentinel: int,
                blocks: list[int], /) -> int | None:
        """``BlockPool.free_held``'s loop: each block's ref count drops; a
        block reaching 0 is linked after the queue's tail if keyed (``gids[b]
        >= 0``) or gathered into a batch spliced before the front if not.
        Null blocks (0) are skipped. The number released, or None (nothing
        changed) when an argument is not what the pool holds."""

    def touch(self, ref: list[int], prev: list[int], next: list[int], blocks: list[int], /) -> int | None:
        """``BlockPool.touch_held``'s loop: each non-null block leaves the free
        queue if its ref count is 0, then its count rises by one. The number
        taken off the queue, or None (nothing changed) when an argument is
        not what the pool holds."""

    def take(self, ref: list[int], hashes: Sequence[object] | None, prev: list[int], next: list[int],
             sentinel: int, n: int, evict: Callable[[int], object],
             maps: tuple[list[int], list[dict[bytes, int]], list[dict[bytes, list[int]]]]
             | tuple[list[int], list[dict[bytes, int]], list[dict[bytes, list[int]]], object] | None = None,
             /) -> list[int] | None:
        """``BlockPool.get_new_blocks``'s loop: the first ``n`` blocks of the
        free queue, in order; ``evict(block)`` is called for each whose hash
        is not None (``hashes`` may be None: caching off), then its ref count
        becomes 1; the queue's front moves past them. The caller has checked
        ``n`` <= the queue's size. None (nothing changed) when an argument
        is not what the pool holds.

        ``maps``: ``(gids, cached_by_group, dup_by_group[, owner])`` when
        eviction announces nothing (kv-cache events off): a block whose key
        no other block duplicates is then evicted in C, as
        ``BlockPool._evict`` does it (its key leaves its group's map, its
        hash becomes None and its group id -1), without the call; any other
        block still goes through ``evict(block)``. With ``owner`` given,
        ``owner.map_epoch += 1`` once when any key was evicted so (the lookup
        memo's epoch, D-PERF-44), on error paths too."""

    def key_run(self, hashes: list[BlockHash | None], gids: list[int], key_tokens: list[int], run: list[int],
                keys: list[BlockHash], group_id: int, first_count: int, step: int, /) -> bool | None:
        """``pool_caching.cache_new_run``'s stores for a run of scattered ids:
        block ``run[i]`` gets hash ``keys[i]``, group ``group_id`` and token
        count ``first_count + i * step``. The caller has checked the rule
        (fresh blocks, new keys). True, or None (nothing changed) when an
        argument is not what the pool holds (the counts must be one-digit
        ints, at least 0)."""

    def map_run(self, table: dict[bytes, int], keys: list[bytes], run: list[int], /) -> bool | None:
        """``pool_caching.cache_new_run``'s map step in one pass: ``table[keys[i]]
        = run[i]`` for every ``i`` when no key is in ``table`` already and
        none repeats in ``keys`` (True); otherwise ``table`` is left as it
        was (False). None (nothing changed) unless ``table`` is an exact
        dict, ``keys`` an exact list of exact bytes (their hashing and
        comparison run no Python code) and ``run`` an exact list as long."""

    def prefix_hits(self, table: dict[bytes, int], hashes: Sequence[bytes], limit: int, owner: object = None,
                    /) -> list[int] | None:
        """The cached prefix of ``hashes[:limit]`` in one group's map:
        ``[table[h] ...]`` for each leading ``h`` that ``table`` holds,
        stopping at the first it does not (the scan of
        ``single_type.FullAttentionManager``). None unless ``table`` is an
        exact dict and ``hashes`` an exact list or tuple whose scanned items
        are exact bytes. ``owner`` (the pool): when given and the hit is not
        empty, its lookup memo is left as ``hit_memo.remember`` leaves it
        (``owner.last_hit = (owner.map_epoch, list(hashes[:len(hit)]), a
        copy of the hit)``, D-PERF-44, D-PERF-48)."""

    def admit(self, context: AdmitContext, blocks: list[int], missing: int, keys: Sequence[BlockHash],
              num_full: int, /) -> tuple[int, list[int] | None, bool | None] | None:
        """``admit_path``'s pool work for a new request of one full-attention
        group (group 0), which holds its hit in ``blocks`` (an exact list):
        1. ``touch(ref, prev, next, blocks)`` when it holds any -> moved;
        2. ``take(ref, hashes, prev, next, sentinel, missing, evict, maps)``
           -> new, appended to ``blocks``;
        3. when ``num_full`` > held: the fresh run ``new[:num_full - held]``
           keyed with ``keys[held:num_full]`` (token counts ``(held + 1) *
           block_size`` onward, step ``block_size``): ``map_run(table, ...)``,
           then, when it answered True, ``key_run(hashes, gids, key_tokens,
           ...)``; asked first whether ``key_run`` takes the run, so the map
           never changes for a run it declines.
        None when step 1 declines or ``blocks``/``num_full`` are not what it
        takes (nothing changed: the caller runs the steps itself), else
        ``(moved, new, keyed)``: ``new`` None when step 2 declined (nothing
        taken, ``keyed`` None); ``keyed`` True when step 3 keyed the run,
        False when ``map_run`` found a key cached already (nothing keyed),
        None when step 3 did not run or ``key_run`` would decline (nothing
        keyed). The caller moves the queue's size (``moved + len(new)``), as
        after the separate calls. An error after step 1 leaves the earlier
        steps done, as an error between the separate calls did (the caller
        recovers)."""

    def lookup(self, context: LookupContext, request: Any, /) -> tuple[Any, int] | None:
        """``KVCacheManager.get_computed_blocks`` for one full-attention group
        once its checks have passed, statistics off: ``(KVCacheBlocks((hit,),
        hashes), hit tokens)`` with ``hit = prefix_hits(table,
        request.block_hashes, (request.num_tokens - 1) // block_size, pool)``,
        the result built without its ``__init__`` (whose whole work is
        storing its two slots). None (nothing changed) when ``prefix_hits``
        declines or ``num_tokens`` is not an exact int; the method then runs
        its own code. An error reading the request propagates."""

    def release_request(self, context: ReleaseContext, request_id: str, /) -> None:
        """``UnitaryCoordinator.release`` for one full-attention group: the
        request leaves the request set and both tables, its block list is
        reversed and released (``release``, or the pool's ``free_held`` where
        that declines), the free queue's size moves. A request id that is
        not an exact str known to all three tables, or a block list that is
        not an exact list, goes to the Python method before any change."""


class NativeTokens(Protocol):
    """What ``optimized/_tokens.c`` provides."""

    def pack(self, tokens: list[int], /) -> bytes | None:
        """``spec.request.pack_token_ids`` in one C pass: the little-endian
        uint32 bytes of ``tokens`` if it is an exact list of exact ints in
        ``[0, 2**31)``, else None."""

    def sha256_blocks(self, packed: bytes, start: int, end: int, size: int, parent: bytes,
                      sha256: Callable[[bytes], Any], /) -> list[BlockHash] | None:
        """The chained sha256 hashes of the blocks of ``size`` tokens in
        ``[start, end)`` of the uint32 tokens ``packed`` (as ``pack`` makes
        them), no extra keys: block ``i``'s hash is
        ``sha256(pickle.dumps((previous hash, tuple(block), None), 5)).digest()``,
        the first block's previous hash being ``parent`` (32 bytes);
        ``sha256`` is ``hashlib.sha256``. None (nothing computed) outside
        that: sizes below 4 or above 8192, a ragged range, a token of
        ``2**31`` or more."""


class NativeDecode(Protocol):
    """What ``optimized/_decode.c`` provides."""

    def noop(self, rules: tuple[tuple[Any, ...], ...], request_id: str, num_computed: int, total: int,
             cache_tokens: int, /) -> bool | None:
        """``decode.is_noop_decode`` over ``rules``: per group a tuple
        ``(req_to_blocks, num_cached_blocks, block_size, extra, cache_size,
        skip, param, align)`` where ``skip`` is 0 (releases nothing), 1 (a
        window: ``num_computed - param + 1`` tokens skipped, at least 0), 2
        (chunks of ``param`` tokens) or 3 (a Mamba state: ``num_computed -
        1``) and ``align`` is a Mamba align group's ``last_state_block`` or
        None. None when an argument is not what it covers."""

    def decode_step(self, context: DecodeContext, request: Any, num_new_tokens: int,
                    delay_cache_blocks: bool, /) -> Any:
        """``decode_path.probed_decode_step``'s step (``context.python_step``),
        its no-op case run in C (D-PERF-50): the same reads of the request in
        the same order, the same checks and ``noop``'s verdict; True gives
        the shared empty result (``context.empty``). Anything else (another
        verdict, a check the step would fail, an attribute missing, a value
        of another type) goes to the Python step, which reads and decides
        again; nothing has changed by then. An error other than a missing
        attribute propagates, as from the step."""


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
    "ADMIT_FIELDS": AdmitContext, "LOOKUP_FIELDS": LookupContext, "RELEASE_FIELDS": ReleaseContext})
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
