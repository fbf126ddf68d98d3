"""Bulk caching of a run of fresh blocks, the common case of
``BlockPool.cache_full_blocks`` (D-PERF-10 has the map's layout).

Split from :mod:`.block_pool` to keep it small. The per-block loop there
stays the definition (null blocks, blocks hashed already, duplicate keys,
masks); this path only takes runs where it would do the obvious thing to
every block, and proves that with whole-list checks before changing
anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.optimized.native import NATIVE
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.optimized.pool.pool_view import PoolView

__all__ = ["cache_new_run"]


def cache_new_run(pool: PoolView, run: Sequence[int], keys: Sequence[BlockHash], group_id: int,
                  first_index: int, block_size: int, fresh: bool = False) -> bool:
    """Key every block of ``run`` (``keys[i]`` for ``run[i]``, the request's
    block ``first_index + i``) with bulk operations, for the rule: no null
    block, none hashed, no key cached or repeated; each key covers
    ``(first_index + i + 1) * block_size`` tokens (KEYTOK-1). Otherwise
    change nothing and return False: the caller goes block by block. Per block this costs a few C steps instead of
    an interpreted iteration: a disjointness probe and one
    ``dict.update`` for the map, and slice stores when the ids are
    consecutive (a fresh pool's queue hands them out so). ``fresh``: the
    caller vouches for the block half of the rule (blocks it has just taken
    from the free queue: distinct, not null, their keys dropped on the way
    out), so only the keys are checked. Cost: O(len(run))."""
    table = pool.cached_by_group[group_id]
    gids = pool._gid
    size, first = len(run), run[0]
    consecutive = (first > 0 and run[-1] - first == size - 1 and type(run) is list
                   and run == pool._ids[first:first + size])
    if fresh:
        pass
    elif consecutive:
        if gids[first:first + size].count(-1) != size:
            return False
    elif (0 in run or list(map(gids.__getitem__, run)).count(-1) != size
          or len(set(run)) != size):  # a block twice: its first key only, per block
        return False
    mapped = (None if NATIVE is None or type(keys) is not list or type(run) is not list
              else NATIVE.map_run(table, keys, run))  # one probe per key, not two (D-PERF-40)
    if mapped is False:
        return False
    if mapped is None:
        if not table.keys().isdisjoint(keys):
            return False  # a key cached already: the duplicate goes apart (D-POOL-5)
        expected = len(table) + size
        table.update(zip(keys, run))
        if len(table) != expected:  # a key twice in the run: the later one goes apart
            for key in keys:  # all were new: dropping them restores the map
                table.pop(key, None)
            return False
    hashes, key_tokens = pool._hash, pool._key_tokens
    start = (first_index + 1) * block_size
    counts = range(start, start + size * block_size, block_size)
    if consecutive:
        hashes[first:first + size] = keys
        gids[first:first + size] = [group_id] * size
        key_tokens[first:first + size] = counts
    elif NATIVE is None or type(keys) is not list or type(run) is not list or NATIVE.key_run(
            hashes, gids, key_tokens, run, keys, group_id, start, block_size) is None:
        for block, key, count in zip(run, keys, counts):
            hashes[block] = key
            gids[block] = group_id
            key_tokens[block] = count
    return True

