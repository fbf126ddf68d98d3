"""The ranked set of a retention pool: which free block goes next (spec/retention.md, RET-4, RET-11).

Semantic model: the free, unpinned blocks, each at a *level*; the victim is
chosen among the levels' earliest blocks by the policy's rule:

- ``lru`` and ``priority``: the lowest non-empty level's earliest block
  (level = effective priority, 0..100; RET-4);
- ``lru-freq``: an unkeyed block first (level 0), else the keyed level
  ``1 + l`` (``l`` = the key's frequency level, 0..3) whose earliest block has
  the least deadline ``tick + l x extension`` (RET-11). Within a level, queue
  order is release order, so each level's earliest block is its least deadline
  and a look at four heads finds the victim.

Representation (O(log n) per eviction):

- ``_seq[b]``: the block's place in the free queue as a number. The kernel's
  queue only grows at its ends (released hashed blocks and
  ``release_to_back`` at the back, released unhashed batches at the front),
  so a counter that rises at the back and one that falls at the front give
  numbers in queue order. Blocks leaving from the middle (hits) need nothing.
- ``_level[b]``: the level the block is ranked at while it is free and
  unpinned, ``-1`` otherwise; ``_levels[p]`` a heap of ``(seq, block)`` per
  level with lazy deletion (an entry counts only while it matches
  ``_level``/``_seq``); ``_count[p]`` the exact number of ranked blocks per
  level and ``_bitmap`` the set of non-empty levels, so the lowest one is
  ``(bitmap & -bitmap).bit_length() - 1``.
- Per tenant with blocks: a heap of ``(level, seq, block)`` (lazy, as above)
  and the exact count of its free cached unpinned blocks (RET-8).
- ``lru-freq``'s memory, kept while it is the policy: releases per key
  ``(hash, group)`` for the last ``FREQ_MEMORY x (N - 1)`` keys released, a
  tick per keyed release, and each block's tick and level at its last keyed
  release (a switch to ``lru-freq`` starts it afresh).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.spec.retention import (
    DEFAULT_PRIORITY,
    FREQ_EXTENSION,
    FREQ_LEVELS,
    FREQ_MEMORY,
    MAX_PRIORITY,
    Policy,
)

__all__ = ["RankedFreePool", "NONE"]

NONE = -1


class RankedFreePool(BlockPool):
    """The kernel pool plus the ranked set of its free unpinned blocks; the
    base of ``RetentionBlockPool``, which sets ``policy``, ``pins``, ``tenant``,
    ``_prio`` and ``_active`` before :meth:`_rebuild`."""

    policy: Policy
    pins: dict[int, tuple[float | None, float | None]]
    tenant: dict[int, str]
    _prio: list[int]
    _active: bool

    def _init_freq(self) -> None:
        """``lru-freq``'s memory, empty (RET-11)."""
        self._memory: OrderedDict[tuple[object, int], int] = OrderedDict()
        self._memory_limit = FREQ_MEMORY * (self.num_blocks - 1)
        self.tick = 0
        self._tick = [0] * self.num_blocks
        self._flevel = [0] * self.num_blocks
        self._extension = (self.num_blocks - 1) * FREQ_EXTENSION[0] // FREQ_EXTENSION[1]

    def _reset_freq(self) -> None:
        """A switch to ``lru-freq``: no key remembered, every block at tick 0, level 0."""
        self._memory.clear()
        self._tick[:] = [0] * self.num_blocks
        self._flevel[:] = [0] * self.num_blocks

    def _count_releases(self, released: Iterable[int]) -> None:
        """Blocks released (in release order): each keyed one counts a release
        of its key and takes the next tick and its key's level (RET-11)."""
        memory, gid, hashes = self._memory, self._gid, self._hash
        for block in released:
            if gid[block] < 0:
                continue
            key = (hashes[block], gid[block])
            releases = memory.pop(key, 0) + 1
            memory[key] = releases
            if len(memory) > self._memory_limit:
                memory.popitem(last=False)
            self.tick += 1
            self._tick[block] = self.tick
            self._flevel[block] = min(releases.bit_length() - 1, FREQ_LEVELS - 1)

    def freq_deadline(self, block: int) -> int | None:
        """``lru-freq``'s deadline of a block (RET-11); ``None`` when unkeyed."""
        if self._gid[block] < 0:
            return None
        return self._tick[block] + self._flevel[block] * self._extension

    def _rebuild(self) -> None:
        """Number the queue afresh and rank every free unpinned block. O(n)."""
        self._seq = [0] * self.num_blocks
        self._level = [NONE] * self.num_blocks
        self._levels: list[list[tuple[int, int]]] = [[] for _ in range(MAX_PRIORITY + 1)]
        self._count = [0] * (MAX_PRIORITY + 1)
        self._bitmap = 0
        self._ranked = 0
        self._tenant_heap: dict[str, list[tuple[int, int, int]]] = {}
        self._tenant_count: dict[str, int] = {}
        order = self._queue.to_list()
        self._front_seq, self._back_seq = 0, len(order)
        for seq, block in enumerate(order):
            self._seq[block] = seq
            if self._active and block not in self.pins:
                self._enter(block)

    def _activate(self) -> None:
        if not self._active:
            self._active = True
            self._rebuild()

    def _rank_of(self, block: int) -> int:
        # Under lru every block ranks at the default: the level's heap is the
        # queue's order, so the victims are the kernel's own (RET-1).
        if self.policy == "lru-freq":
            return 0 if self._gid[block] < 0 else 1 + self._flevel[block]
        if self.policy == "lru" or self._gid[block] < 0 or self._prio[block] < 0:
            return DEFAULT_PRIORITY
        return self._prio[block]

    def _enter(self, block: int) -> None:
        """Rank a free unpinned block at its level (RET-4)."""
        level = self._rank_of(block)
        self._level[block] = level
        heapq.heappush(self._levels[level], (self._seq[block], block))
        self._count[level] += 1
        self._bitmap |= 1 << level
        self._ranked += 1
        tenant = self.tenant.get(block)
        if tenant is not None and self._gid[block] >= 0:
            heapq.heappush(self._tenant_heap.setdefault(tenant, []), (level, self._seq[block], block))
            self._tenant_count[tenant] = self._tenant_count.get(tenant, 0) + 1

    def _leave(self, block: int) -> None:
        """Unrank a block (taken, hit, pinned or re-ranked); its heap entries go stale."""
        level = self._level[block]
        if level < 0:
            return
        self._level[block] = NONE
        self._count[level] -= 1
        if not self._count[level]:
            self._bitmap &= ~(1 << level)
        self._ranked -= 1
        tenant = self.tenant.get(block)
        if tenant is not None and self._gid[block] >= 0:
            self._tenant_count[tenant] -= 1

    def _head(self, level: int) -> tuple[int, int]:
        """The earliest ``(seq, block)`` of a non-empty level; stale entries dropped."""
        heap = self._levels[level]
        seq_of, level_of = self._seq, self._level
        while True:
            seq, block = heap[0]
            if level_of[block] == level and seq_of[block] == seq:
                return seq, block
            heapq.heappop(heap)

    def _pop_victim(self) -> int:
        """The policy's next victim, unranked (RET-4, RET-11). O(log n) amortised."""
        bitmap = self._bitmap
        level = (bitmap & -bitmap).bit_length() - 1
        keyed = bitmap >> 1 & ((1 << FREQ_LEVELS) - 1)
        if self.policy == "lru-freq" and level > 0 and keyed & (keyed - 1):  # two levels or more
            best: tuple[int, int] | None = None
            for candidate in range(1, FREQ_LEVELS + 1):
                if bitmap >> candidate & 1:
                    seq, block = self._head(candidate)
                    key = (self._tick[block] + (candidate - 1) * self._extension, seq)
                    if best is None or key < best:
                        best, level = key, candidate
        _, block = self._head(level)
        heapq.heappop(self._levels[level])
        self._leave(block)
        return block

    def _tenant_victim(self, tenant: str) -> int:
        """The tenant's own next victim (RET-8): its heap's head, or under
        ``lru-freq`` its least ``(deadline, seq)`` found by a scan of its live
        entries (quota evictions are rare; O(entries))."""
        heap = self._tenant_heap[tenant]
        if self.policy == "lru-freq":
            live = [(self.freq_deadline(block) or 0, seq, block) for level, seq, block in heap
                    if self._live_tenant_entry(tenant, level, seq, block)]
            return min(live)[2]
        while True:
            level, seq, block = heapq.heappop(heap)
            if self._live_tenant_entry(tenant, level, seq, block):
                return block

    def _live_tenant_entry(self, tenant: str, level: int, seq: int, block: int) -> bool:
        return (self._level[block] == level and self._seq[block] == seq and self._gid[block] >= 0
                and self.tenant.get(block) == tenant)
