"""Caching blocks: giving a request's full blocks their cache keys
(``PoolCaching.cache_full_blocks``, a base of :class:`.block_pool.BlockPool`)
and its bulk case for a run of fresh blocks (:func:`cache_new_run`; D-PERF-10
has the map's layout).

The per-block loop of ``cache_full_blocks_unchecked`` stays the definition
(null blocks, blocks hashed already, duplicate keys, masks); the bulk path
only takes runs where that loop would do the obvious thing to every block,
and proves that with whole-list checks before changing anything.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.native import NATIVE
from pagedkv.optimized.pool.pool_events import stored_events
from pagedkv.optimized.pool.pool_view import PoolView
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.stored_events import PER_CALL
from pagedkv.spec.types import BlockHash

__all__ = ["PoolCaching", "cache_new_run"]


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


class PoolCaching(PoolView):
    """Keying a request's full blocks: the map's writes (CACHE-1, KEYTOK-1,
    D-POOL-5). The pool's other changes are :class:`.block_pool.BlockPool`'s,
    whose constructor sets the two settings below."""

    block_stored_events: str
    num_hash_lookahead_tokens: int

    def cache_full_blocks(
        self,
        request: HashedRequest,
        blocks: Sequence[int],
        *,
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        mask: Sequence[bool] | None = None,
    ) -> None:
        """Give blocks ``[num_cached_blocks, num_full_blocks)`` of
        ``blocks`` the keys ``block_hashes[i] + group_id``; ``block_hashes``
        is the group's view of the request's hashes (at ``block_size``). Null
        blocks, blocks already hashed and blocks the ``mask`` (indexed from
        ``num_cached_blocks``) rules out are skipped. With events on, one
        ``BlockStored`` for the call, or one per contiguous run of newly
        hashed blocks, as ``block_stored_events`` says (D-EVT-15).
        No-op with caching disabled.

        Cost: O(num_full_blocks - num_cached_blocks).

        Raises:
            InvalidArgumentError: ``group_id`` is out of range, or
                ``num_full_blocks`` exceeds ``len(blocks)`` or the hashes
                (no change).
        """
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        if not 0 <= group_id < self.num_groups:
            raise InvalidArgumentError(
                f"group_id must lie in [0, {self.num_groups}), got {group_id!r}")
        if num_cached_blocks < 0 or num_full_blocks > len(blocks) or (
                num_full_blocks > len(block_hashes)):
            raise InvalidArgumentError(
                f"cannot cache blocks [{num_cached_blocks}, {num_full_blocks}): the request "
                f"holds {len(blocks)} blocks and {len(block_hashes)} block hashes")
        self.cache_full_blocks_unchecked(request, blocks, block_hashes=block_hashes,
                                         num_cached_blocks=num_cached_blocks,
                                         num_full_blocks=num_full_blocks,
                                         block_size=block_size, group_id=group_id, mask=mask)

    def cache_full_blocks_unchecked(
        self,
        request: HashedRequest,
        blocks: Sequence[int],
        *,
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        mask: Sequence[bool] | None,
    ) -> None:
        """:meth:`cache_full_blocks` without validation: caching on,
        ``group_id`` in range, ``0 <= num_cached_blocks < num_full_blocks <=
        min(len(blocks), len(block_hashes))``. Cost: O(num_full_blocks - num_cached_blocks)."""
        # Runs of newly hashed positions: (first index, hashes), for events.
        runs: list[tuple[int, list[BlockHash]]] = []
        call = (num_cached_blocks, num_full_blocks)  # the range a per-call event covers
        if mask is None and num_full_blocks - num_cached_blocks > 1:
            # The rule first, in bulk (pool_caching.py); one block (a decode
            # step filling its block) costs less through the loop below.
            keys = block_hashes[num_cached_blocks:num_full_blocks]
            if cache_new_run(self, blocks[num_cached_blocks:num_full_blocks], keys, group_id,
                             num_cached_blocks, block_size):
                if self.enable_kv_cache_events:
                    runs.append((num_cached_blocks, list(keys)))
                num_full_blocks = num_cached_blocks  # done: skip the per-block loop
        hashes = self._hash
        gids = self._gid
        table = self.cached_by_group[group_id]
        events = self.enable_kv_cache_events
        last = -2
        setdefault = table.setdefault
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            # gids, not hashes: testing a hash would touch its bytes object (see _gid).
            if not block or gids[block] >= 0 or (
                    mask is not None and not mask[i - num_cached_blocks]):
                continue
            block_hash = block_hashes[i]  # its own position's key (REQ-7), its prefix's tokens (KEYTOK-1)
            hashes[block] = block_hash
            gids[block] = group_id
            self._key_tokens[block] = (i + 1) * block_size
            # One probe of the table; a key already cached (identical
            # blocks, rare) records this block as a later holder.
            if setdefault(block_hash, block) != block:
                self.dup_by_group[group_id].setdefault(block_hash, []).append(block)
            if events:
                if i == last + 1:
                    runs[-1][1].append(block_hash)
                else:
                    runs.append((i, [block_hash]))
                last = i
        if events and (runs or self.block_stored_events == PER_CALL):
            self._events.extend(stored_events(
                request, runs, block_hashes, block_size, group_id, self.num_hash_lookahead_tokens,
                call if self.block_stored_events == PER_CALL else None))
