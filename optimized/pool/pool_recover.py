"""Recovery of the block pool's state after an interrupted change (D-API-24).

Split from :mod:`.block_pool`: it rebuilds the whole state from the parts
that survive (the holders the managers report, the blocks' own hashes, the
queue as far as it can be walked), so it is a rare, O(num_blocks) path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.optimized.pool.pool_view import PoolTables

__all__ = ["recover_pool"]


def recover_pool(pool: PoolTables, holders: Mapping[int, int]) -> None:
    """Make ``pool`` consistent: ref counts from ``holders`` (id -> holding
    positions over all requests) plus the reserved blocks; the cache map
    from the blocks' own hashes; the free queue from the ref counts, in its
    old order as far as it can be walked. Every list is changed in place
    (decode closures hold them). Cost: O(num_blocks + cached keys)."""
    num_blocks, reserved = pool.num_blocks, set(pool.reserved)
    pool.map_epoch += 1  # the maps are rebuilt: no lookup memo survives (D-PERF-44)
    ref, hashes, gids = pool._ref, pool._hash, pool._gid
    for block in range(num_blocks):
        ref[block] = 0 if block == 0 else holders.get(block, 0) + (block in reserved)
        if (block == 0 or block in reserved or not pool.enable_caching or hashes[block] is None
                or not 0 <= gids[block] < pool.num_groups):
            hashes[block], gids[block] = None, -1
    # Every key's holders in their old order as far as they are valid, then
    # the hashed blocks the map lost; stored back as first + later holders.
    kept: list[dict[bytes, list[int]]] = []
    for group_id, table in enumerate(pool.cached_by_group):
        dups = pool.dup_by_group[group_id] if group_id < len(pool.dup_by_group) else {}
        kept.append({key: [b for b in dict.fromkeys([first, *dups.get(key, ())])
                           if type(b) is int and 0 < b < num_blocks
                           and hashes[b] == key and gids[b] == group_id]
                     for key, first in table.items()})
    for block in range(1, num_blocks):
        block_hash = hashes[block]
        if block_hash is not None:
            holders_of_key = kept[gids[block]].setdefault(block_hash, [])
            if block not in holders_of_key:
                holders_of_key.append(block)
    del pool.dup_by_group[len(kept):]
    pool.dup_by_group.extend({} for _ in range(len(kept) - len(pool.dup_by_group)))
    for table, dups, holders_by_key in zip(pool.cached_by_group, pool.dup_by_group, kept):
        table.clear()
        dups.clear()
        for key, holders_of_key in holders_by_key.items():
            if holders_of_key:
                table[key] = holders_of_key[0]
                if len(holders_of_key) > 1:
                    dups[key] = holders_of_key[1:]
    queue = pool._queue
    order = dict.fromkeys(b for b in [*queue.walk(num_blocks), *pool._ids[1:num_blocks]]
                          if 0 < b < num_blocks and ref[b] == 0)
    queue.reset(order)
    if not pool.enable_kv_cache_events:
        pool._events.clear()

