"""The pool's lookup memo (D-PERF-44): why admitting a hit right after its
lookup needs no second probe of the map per hit block.

``allocate_slots`` must refuse a stale hit: each hit block has to be the
block the map serves for the request's hash at its position (spec/
operations.md, checks 1h, 1h' and 1i). Checked directly, that is one map
probe per hit block, and in a large map every probe misses the CPU cache
several times (the index slot, the entry, the stored key, the block id) —
the very work the lookup did a moment before, done again.

A full-attention lookup therefore leaves a memo on the pool:
``(map_epoch, hashes, hit)``, the hashes it scanned and the blocks the map
served. ``map_epoch`` moves whenever a key leaves a map or a map entry
moves to another block; adding keys never changes what the map serves for
a key it held. So while the epoch stands, a hit whose items are the very
objects of the memo's hit, for a request whose hashes start with the very
objects of the memo's hashes, is what the map serves for them now: the
check holds without probing. Anything else (another epoch, another list,
an equal but not identical item) is checked the direct way. Identity, not
equality, is compared, so no item's memory is read, and an item that is
not an exact ``int`` can never pass (the memo's items are the map's).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_
from typing import TYPE_CHECKING

from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.optimized.pool.pool_view import PoolTables

__all__ = ["remember", "same_prefix", "vouches"]


def same_prefix(items: Sequence[object], prefix: Sequence[object]) -> bool:
    """True when ``items`` starts with the very objects (identity) of
    ``prefix``. Cost: O(len(prefix)), one C-level pass (``map`` over
    ``operator.is_``; a C twin of it did not pay, D-PERF-52)."""
    return len(items) >= len(prefix) and all(map(is_, items, prefix))


def remember(pool: PoolTables, block_hashes: Sequence[BlockHash], hit: list[int]) -> None:
    """Leave the memo of a lookup that found ``hit`` for ``block_hashes``
    (the C scan, ``prefix_hits(..., owner=pool)``, leaves the same one itself,
    D-PERF-48). Cost: O(len(hit)) (two copies)."""
    keys = block_hashes[:len(hit)]
    pool.last_hit = (pool.map_epoch, keys if type(keys) is list else list(keys), hit[:])


def vouches(pool: PoolTables, block_hashes: Sequence[BlockHash], hit: Sequence[int]) -> bool:
    """True when the memo proves ``hit`` is what the map serves for the
    leading hashes of ``block_hashes`` now (a non-empty list hit); False
    means only "not proven here". Cost: O(len(hit)), no map probe."""
    memo = pool.last_hit
    return (memo is not None and memo[0] == pool.map_epoch and type(hit) is list
            and len(hit) == len(memo[2]) != 0 and same_prefix(hit, memo[2])
            and same_prefix(block_hashes, memo[1]))
