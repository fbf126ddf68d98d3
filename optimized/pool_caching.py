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

from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from .block_pool import BlockPool

__all__ = ["cache_new_run", "record_key_tokens"]


def cache_new_run(pool: BlockPool, run: Sequence[int], keys: Sequence[BlockHash], group_id: int) -> bool:
    """Key every block of ``run`` (``keys[i]`` for ``run[i]``) with bulk
    operations, for the rule: no null block, none hashed, no key cached
    or repeated. Otherwise change nothing and return False: the caller
    goes block by block. Per block this costs a few C steps instead of
    an interpreted iteration: a disjointness probe and one
    ``dict.update`` for the map, and slice stores when the ids are
    consecutive (a fresh pool's queue hands them out so).
    Cost: O(len(run))."""
    table = pool.cached_by_group[group_id]
    gids = pool._gid
    size, first = len(run), run[0]
    consecutive = (first > 0 and run[-1] - first == size - 1 and type(run) is list
                   and run == list(range(first, first + size)))
    if consecutive:
        if gids[first:first + size].count(-1) != size:
            return False
    elif (0 in run or list(map(gids.__getitem__, run)).count(-1) != size
          or len(set(run)) != size):  # a block twice: its first key only, per block
        return False
    if not table.keys().isdisjoint(keys):
        return False  # a key cached already: the duplicate goes apart (D-POOL-5)
    expected = len(table) + size
    table.update(zip(keys, run))
    if len(table) != expected:  # a key twice in the run: the later one goes apart
        for key in keys:  # all were new: dropping them restores the map
            table.pop(key, None)
        return False
    hashes = pool._hash
    if consecutive:
        hashes[first:first + size] = keys
        gids[first:first + size] = [group_id] * size
    else:
        for block, key in zip(run, keys):
            hashes[block] = key
            gids[block] = group_id
    return True


def record_key_tokens(key_tokens: list[int], run: Sequence[int], first_index: int, block_size: int) -> None:
    """Record, for a run :func:`cache_new_run` keyed, the tokens each key
    covers: ``(first_index + k + 1) * block_size`` for ``run[k]`` (KEYTOK-1).
    A slice store when the ids are consecutive. Cost: O(len(run))."""
    start = (first_index + 1) * block_size
    counts = range(start, start + len(run) * block_size, block_size)
    first = run[0]
    if run[-1] - first == len(run) - 1 and list(run) == list(range(first, first + len(run))):
        key_tokens[first:first + len(run)] = counts
    else:
        for block, count in zip(run, counts):
            key_tokens[block] = count
