"""Sub-block (partial) prefix hits for Mamba ``align`` groups: the pool edits
they need (spec/mamba.md, "Sub-block hits", MPART-1..4).

A partial key sits on a block exactly like a full-block key (one key per
block, D-MAMBA-16), so the pool's tables stay as they are; these helpers
place one on an unkeyed block and move one to another block without the
validation or events of the pool's public operations (D-MAMBA-18).
"""

from __future__ import annotations

from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.spec.types import BlockHash

__all__ = ["key_block", "move_key"]


def key_block(pool: BlockPool, block: int, block_hash: BlockHash, group_id: int, num_tokens: int) -> None:
    """Give the unkeyed real ``block`` the key ``block_hash`` (the state after
    ``num_tokens`` tokens) in ``group_id``. Cost: O(1)."""
    assert block and pool._gid[block] < 0
    pool._hash[block] = block_hash
    pool._gid[block] = group_id
    pool._key_tokens[block] = num_tokens
    # The first holder of a key is the table's; identical later ones go to the side map (D-PERF-10).
    if pool.cached_by_group[group_id].setdefault(block_hash, block) != block:
        pool.dup_by_group[group_id].setdefault(block_hash, []).append(block)


def move_key(pool: BlockPool, source: int, destination: int) -> None:
    """Re-point ``source``'s key, if any, at the unkeyed ``destination``, which
    takes ``source``'s place among the key's holders. Cost: O(1) (O(duplicates)
    for a key several blocks carry)."""
    group_id = pool._gid[source]
    assert pool._gid[destination] < 0
    if group_id < 0:
        return
    block_hash = pool._hash[source]
    assert block_hash is not None
    table = pool.cached_by_group[group_id]
    pool.map_epoch += 1  # a map entry may move to another block (D-PERF-44)
    if table[block_hash] == source:
        table[block_hash] = destination
    else:
        later = pool.dup_by_group[group_id][block_hash]
        later[later.index(source)] = destination
    pool._hash[destination], pool._gid[destination] = block_hash, group_id
    pool._key_tokens[destination] = pool._key_tokens[source]
    pool._hash[source], pool._gid[source] = None, -1
