"""The block pool over integer block ids (spec/state.md, "Block pool").

Semantic model: ``num_blocks`` numbered blocks. Block 0 is the null block, a
placeholder that is never allocated, hashed, freed or counted. Every other
block is free (queued, ref count 0) or in use (ref count = holders). A
block may carry a cache key (block hash + group id); a free block with a
key is an eviction candidate a prefix hit can still revive. Lifecycle:
free -> allocated -> full and hashed -> freed and evictable -> evicted (on
reuse or ``evict_blocks``) or hit again (``touch``); see
``pagedkv.spec.protocols``.

The representation (the tables, indexed by block id) is described, declared and
checked in :mod:`.pool_view`.

Public methods validate their arguments and raise typed errors before any
change. The ``touch_held`` / ``free_held`` / ``cache_full_blocks_unchecked``
variants skip validation; the managers and the coordinator's decode fast
path call them with ids they hold, valid by construction (REQ-1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from pagedkv.optimized.native import NATIVE
from pagedkv.optimized.pool.free_queue import FreeBlockQueue
from pagedkv.optimized.pool.pool_caching import PoolCaching
from pagedkv.optimized.pool.pool_recover import recover_pool
from pagedkv.optimized.pool.pool_view import NULL_BLOCK
from pagedkv.spec.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    InvariantViolation,
    PoolExhaustedError,
)
from pagedkv.spec.stored_events import PER_CALL, check_block_stored_events
from pagedkv.spec.types import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    KVCacheEvent,
)

__all__ = ["BlockPool", "NULL_BLOCK"]

class BlockPool(PoolCaching):
    """A pool of ``num_blocks`` integer-id blocks with a prefix cache.

    Args:
        num_blocks: total blocks, the null block included (>= 1).
        enable_caching: when false, blocks never get hashes and allocation
            never evicts.
        enable_kv_cache_events: collect events for :meth:`take_events`.
        num_groups: number of KV cache groups; group ids of cache keys lie in
            ``[0, num_groups)`` (CACHE-3).
        block_stored_events: ``"per_call"`` (vLLM's one ``BlockStored`` per
            caching call) or ``"per_run"`` (one per contiguous run of newly
            cached blocks); :mod:`pagedkv.spec.stored_events`.

    Raises:
        InvalidConfigError: ``num_blocks``, ``num_groups`` or
            ``block_stored_events`` malformed.
    """

    __slots__ = (
        "num_blocks", "enable_caching", "enable_kv_cache_events",
        "num_groups", "_ids", "_ref", "_hash", "_gid", "_key_tokens", "cached_by_group", "dup_by_group",
        "_queue", "_events", "reserved", "num_hash_lookahead_tokens", "map_epoch", "last_hit",
        "last_scan", "block_stored_events",
    )

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        *,
        enable_kv_cache_events: bool = False,
        num_groups: int = 1,
        block_stored_events: str = PER_CALL,
    ) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise InvalidConfigError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if type(num_groups) is not int or num_groups < 0:
            raise InvalidConfigError(f"num_groups must be an int >= 0, got {num_groups!r}")
        self.block_stored_events = check_block_stored_events(block_stored_events)
        self.num_blocks = num_blocks
        self.enable_caching = bool(enable_caching)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.num_groups = num_groups
        # One int object per id (the sentinel's too), handed out by allocation
        # and linked by the queue: comparing runs of ids then mostly compares
        # pointers, and taking a fresh run creates no int (D-PERF-18).
        self._ids: list[int] = list(range(num_blocks + 1))
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._gid: list[int] = [-1] * num_blocks
        # Tokens each key covers (KEYTOK-1), read only while the block is keyed.
        self._key_tokens: list[int] = [0] * num_blocks
        self.cached_by_group: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.dup_by_group: list[dict[bytes, list[int]]] = [{} for _ in range(num_groups)]
        # The null block is never queued (POOL-1).
        self._queue = FreeBlockQueue(num_blocks, self._ids[1:num_blocks])
        self._events: list[KVCacheEvent] = []
        # Blocks held for the pool's lifetime (attention sinks, D-SINK-1).
        self.reserved: list[int] = []
        # Tokens after each block its hash covers (spec/hashing.md section 7):
        # events carry them; the manager sets it.
        self.num_hash_lookahead_tokens = 0
        self.map_epoch = 0
        self.last_hit: tuple[int, list[BlockHash], list[int]] | None = None
        # A full-attention group's last prefix scan (epoch, group id, view,
        # blocks found): its hit blocks reuse it (D-PERF-46).
        self.last_scan: tuple[int, int, Sequence[BlockHash], list[int]] | None = None

    # ------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the front of the free queue, in
        order; each popped block that carries a key is evicted first (map
        entry removed, ``BlockRemoved`` event); each gets ref count 1.

        Cost: O(num_blocks).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.
            PoolExhaustedError: fewer free blocks than asked for (no change).
        """
        if type(num_blocks) is not int or num_blocks < 0:  # EVICT-1
            raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        queue = self._queue
        if num_blocks > queue.size:
            raise PoolExhaustedError(
                f"asked for {num_blocks} blocks, {queue.size} are free")
        # Fused pop + evict + ref update (EVICT-2..5); locals bound for the loop.
        nxt = queue.next
        sentinel = queue.sentinel
        ref = self._ref
        hashes = self._hash
        block = nxt[sentinel]
        end = block + num_blocks
        if num_blocks > 1 and nxt[block] == block + 1:
            # Consecutive ids linked in order (a fresh pool's queue): checked
            # and taken with slices when none carries a key.
            out = self._ids[block:end]
            if nxt[block:end - 1] == out[1:] and self._gid[block:end].count(-1) == num_blocks:
                ref[block:end] = [1] * num_blocks
                block = nxt[end - 1]
                nxt[sentinel] = block
                queue.prev[block] = sentinel
                queue.size -= num_blocks
                return out
        if NATIVE is not None:
            # Without events an eviction announces nothing: the C loop drops
            # an unduplicated key itself (maps), the rest through _evict.
            # (An eviction in C moves map_epoch itself: the pool is the maps' owner.)
            in_place = self.enable_caching and not self.enable_kv_cache_events
            taken = NATIVE.take(ref, hashes if self.enable_caching else None, queue.prev, nxt, sentinel,
                                num_blocks, self._evict,
                                (self._gid, self.cached_by_group, self.dup_by_group, self) if in_place else None)
            if taken is not None:
                queue.size -= num_blocks
                return taken
        out = [0] * num_blocks
        if self.enable_caching:
            evict = self._evict
            for i in range(num_blocks):
                out[i] = block  # EVICT-2
                if hashes[block] is not None:
                    evict(block)  # EVICT-3, EVICT-4
                ref[block] = 1  # EVICT-5
                block = nxt[block]
        else:
            for i in range(num_blocks):
                out[i] = block
                ref[block] = 1
                block = nxt[block]
        nxt[sentinel] = block
        queue.prev[block] = sentinel
        queue.size -= num_blocks
        return out

    def reserve(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front for good (attention sink
        blocks): ref count 1, never freed, never hashed (SINK-1).

        Cost: O(num_blocks).

        Raises:
            PoolExhaustedError: fewer free blocks than asked for (no change).
        """
        blocks = self.get_new_blocks(num_blocks)
        self.reserved.extend(blocks)
        return blocks

    def _evict(self, block: int, announce: bool = True) -> None:
        """Drop ``block``'s key (it must carry one), with a ``BlockRemoved``
        event when events are on and ``announce`` (a partial key giving way
        to the block's full key goes silently, FPART-4). Cost: O(1)
        amortised (O(duplicates of the key) when identical blocks share it)."""
        block_hash = self._hash[block]
        assert block_hash is not None
        group_id = self._gid[block]
        table, dups = self.cached_by_group[group_id], self.dup_by_group[group_id]
        self.map_epoch += 1
        later = dups.get(block_hash) if dups else None  # the rule: no duplicates at all
        if later is None:  # EVICT-3
            del table[block_hash]
        else:
            if table[block_hash] == block:
                table[block_hash] = later.pop(0)
            else:
                later.remove(block)
            if not later:
                del dups[block_hash]
        self._hash[block] = None  # EVICT-4
        self._gid[block] = -1
        if announce and self.enable_kv_cache_events:
            self._events.append(BlockRemoved(block_hashes=(block_hash,), medium=MEDIUM_GPU, group_idx=group_id))

    def touch(self, blocks: Iterable[int]) -> None:
        """For each non-null block in order: leave the free queue if its ref
        count is 0, then ref count += 1.

        Cost: O(len(blocks)).

        Raises:
            UnknownBlockError: an id outside ``[0, num_blocks)`` (no change).
        """
        ids = list(blocks)
        self._check_ids(ids)
        self.touch_held(ids)

    def touch_held(self, blocks: Iterable[int]) -> None:
        """:meth:`touch` without validation (ids held by the caller)."""
        queue = self._queue
        prev, nxt = queue.prev, queue.next  # locals: O(1) unlink inlined below
        ref = self._ref
        if NATIVE is not None and type(blocks) is list:
            taken = NATIVE.touch(ref, prev, nxt, blocks)
            if taken is not None:
                queue.size -= taken
                return
        removed = 0
        for block in blocks:
            if not block:  # the null block's counters never move (D-POOL-1)
                continue
            count = ref[block]
            if count == 0:
                before, after = prev[block], nxt[block]
                nxt[before] = after
                prev[after] = before
                removed += 1
            ref[block] = count + 1
        queue.size -= removed

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Release one reference of each non-null block, in the caller's
        order. Blocks reaching 0 in this call return to the queue: unhashed
        ones to the front as one batch in release order, hashed ones to the
        back in release order (D-POOL-2).

        Cost: O(len(blocks)).

        Raises:
            UnknownBlockError: an id outside ``[0, num_blocks)``.
            InvariantViolation: a block would be released more often than it
                is referenced (POOL-3). No change in either case.
        """
        ids = list(blocks)
        self._check_ids(ids)
        ref = self._ref
        for block, times in Counter(b for b in ids if b).items():  # FREE-3
            if ref[block] < times:
                raise InvariantViolation(
                    f"POOL-3: freeing block {block} {times} time(s) but its ref count is "
                    f"{ref[block]}")
        if len(set(ids)) != len(ids):
            self._free_with_duplicates(ids)
        else:
            self.free_held(ids, with_null=True)

    def release_to_back(self, blocks: Iterable[int]) -> None:
        """Drop one reference of each held block (none twice, no null); those at 0 join the
        back of the queue, hashed or not: still read until reused, so reused last (D-HOST-20)."""
        ids, ref = list(blocks), self._ref
        self._check_ids(ids)
        if 0 in ids or len(set(ids)) != len(ids) or any(ref[b] < 1 for b in ids):
            raise InvariantViolation(f"POOL-3: release_to_back of {ids} (held once each, no null)")
        for block in ids:
            ref[block] -= 1
        self._queue.push_back([block for block in ids if not ref[block]])

    def _free_with_duplicates(self, ids: list[int]) -> None:
        """:meth:`free_blocks` for a list naming a block more than once: a
        block is released at the occurrence that brings its count to 0
        (D-API-35). Cost: O(len(ids))."""
        ref = self._ref
        released = []
        for block in ids:
            if block:
                ref[block] -= 1
                if not ref[block]:
                    released.append(block)
        for block in released:
            ref[block] = 1
        self.free_held(released)

    def free_held(self, blocks: Iterable[int], *, with_null: bool = False) -> None:
        """:meth:`free_blocks` without validation: ids held by the caller,
        none twice; null blocks only ``with_null`` (skipped). One fused
        pass: each block's count drops; a block reaching 0 is linked
        straight after the queue's tail if hashed, or gathered for the front
        batch if not (rare: a request's partial last block).

        Cost: O(len(blocks)): per block that stays referenced one list load
        and store; per block released four stores and two loads, none of
        which touch the block's hash object (see ``_gid``).
        """
        queue = self._queue
        prev, nxt = queue.prev, queue.next  # locals: links spliced inline
        sentinel = queue.sentinel
        ref = self._ref
        gids = self._gid
        if NATIVE is not None and type(blocks) is list:
            released = NATIVE.release(ref, gids, prev, nxt, sentinel, blocks)  # skips null blocks
            if released is not None:
                queue.size += released
                return
        if with_null:
            blocks = filter(None, blocks)
        tail = prev[sentinel]  # hashed blocks are linked straight after it
        front: list[int] | None = None  # unhashed ones are rare: built lazily
        released = 0
        for block in blocks:  # FREE-4, and FREE-5's links
            count = ref[block]
            if count != 1:  # stays referenced (the caller holds it: count >= 1)
                ref[block] = count - 1
                continue
            ref[block] = 0
            released += 1
            if gids[block] >= 0:
                nxt[tail] = block
                prev[block] = tail
                tail = block
            elif front is None:
                front = [block]
            else:
                front.append(block)
        if not released:
            return
        nxt[tail] = sentinel
        prev[sentinel] = tail
        queue.size += released
        if front is not None:
            # Splice the unhashed batch before the (possibly new) front.
            old_front = nxt[sentinel]
            last = sentinel
            for block in front:
                nxt[last] = block
                prev[block] = last
                last = block
            nxt[last] = old_front
            prev[old_front] = last

    # --------------------------------------------------------------- caching
    # (keying blocks: PoolCaching.cache_full_blocks, pool_caching.py)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the keys of the given blocks, in the given order (each
        emits ``BlockRemoved``). Blocks stay where they are in the queue and
        keep their ref counts; unhashed blocks and the null block: no-op.

        Cost: O(len(block_ids)).

        Raises:
            UnknownBlockError: an id is not an int in ``[0, num_blocks)``
                (checked for all ids before any change).
        """
        ids = list(block_ids)
        self._check_ids(ids)
        hashes = self._hash
        for block in ids:
            if block and hashes[block] is not None:
                self._evict(block)

    def recover(self, holders: Mapping[int, int]) -> None:
        """Make the pool consistent after an interrupted change (D-API-24):
        see :func:`pagedkv.optimized.pool.pool_recover.recover_pool`.
        Cost: O(num_blocks + cached keys)."""
        recover_pool(self, holders)

    def reset_prefix_cache(self) -> bool:
        """Drop every key if no block but the null block (and reserved sink
        blocks) is in use, append
        ``AllBlocksCleared`` (events on) and return True; otherwise return
        False and change nothing. The free queue order is unchanged.

        Cost: O(num_blocks) on success, O(1) on refusal.
        """
        if self._queue.size != self.num_blocks - 1 - len(self.reserved):
            # RESET-1: some non-null, non-reserved block has ref count > 0 (POOL-2);
            # reserved sink blocks never count as in use (D-SINK-2).
            return False
        self.map_epoch += 1  # RESET-2
        for table in self.cached_by_group:
            table.clear()
        for dups in self.dup_by_group:
            dups.clear()
        self._hash[:] = [None] * self.num_blocks  # in place: views share the list
        self._gid[:] = [-1] * self.num_blocks
        if self.enable_kv_cache_events:  # RESET-3
            self._events.append(AllBlocksCleared())
        return True

    # ---------------------------------------------------------------- events

    def take_events(self) -> list[KVCacheEvent]:
        """Pending events, oldest first; empties the queue. Cost: O(1)."""
        events = self._events
        self._events = []
        return events
