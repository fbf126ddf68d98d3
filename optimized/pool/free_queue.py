"""The free block queue as an intrusive doubly linked list over block ids.

Semantic model: an ordered sequence of distinct block ids, front = the block
allocated next (spec/state.md, POOL-2). The pool needs four things of it,
all without creating a Python object per operation:

- pop ``n`` ids from the front (allocation),
- remove one id from anywhere (a prefix hit revives a free cached block),
- push a batch to the front keeping its order (released unhashed blocks),
- push a batch to the back keeping its order (released hashed blocks, LRU).

Representation: two plain ``list[int]`` arrays ``prev`` and ``next`` indexed
by block id, plus one sentinel slot at index ``num_blocks`` that closes the
ring (``next[S]`` is the front, ``prev[S]`` the back; empty iff
``next[S] == S``). Plain lists are used because indexing a list of small
ints is the cheapest indexed load CPython has: ``array`` and numpy box a new
int object on every read. The links of an id that is not in the queue are
stale and never read: membership is decided by the pool (a non-null block
is queued iff its ref count is 0).

The pool's hot loops read ``prev``/``next``/``sentinel`` directly (bound to
locals) instead of calling methods, to save the call overhead per block; the
methods here are the definition those loops inline.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FreeBlockQueue"]


class FreeBlockQueue:
    """Ordered set of free block ids with O(1) removal from the middle.

    ``FreeBlockQueue(num_blocks, initial)`` holds the ids of ``initial`` in
    order; every id must lie in ``[0, num_blocks)``.
    """

    __slots__ = ("prev", "next", "sentinel", "size")

    def __init__(self, num_blocks: int, initial: Iterable[int] = ()) -> None:
        sentinel = num_blocks
        self.sentinel = sentinel
        self.prev: list[int] = [sentinel] * (num_blocks + 1)
        self.next: list[int] = [sentinel] * (num_blocks + 1)
        self.size = 0
        self.push_back(initial)

    def __len__(self) -> int:
        """Number of queued ids. Cost: O(1)."""
        return self.size

    def front(self) -> int | None:
        """The id allocated next, or ``None`` when empty. Cost: O(1)."""
        head = self.next[self.sentinel]
        return None if head == self.sentinel else head

    def pop_front(self, n: int) -> list[int]:
        """Remove and return the first ``n`` ids, front first.

        Cost: O(n).

        Raises:
            IndexError: fewer than ``n`` ids are queued (nothing removed).
        """
        if n > self.size or n < 0:
            raise IndexError(f"pop_front({n}) from a queue of {self.size}")
        nxt = self.next  # local binding: read once per id below
        block = nxt[self.sentinel]
        out = [0] * n
        for i in range(n):
            out[i] = block
            block = nxt[block]
        nxt[self.sentinel] = block
        self.prev[block] = self.sentinel
        self.size -= n
        return out

    def remove(self, block: int) -> None:
        """Unlink ``block`` (which must be queued) from wherever it is.

        Cost: O(1). The caller guarantees membership; a block not queued
        corrupts the ring (the pool decides membership by ref count).
        """
        prev, nxt = self.prev, self.next
        before, after = prev[block], nxt[block]
        nxt[before] = after
        prev[after] = before
        self.size -= 1

    def push_back(self, blocks: Iterable[int]) -> None:
        """Append ``blocks`` at the back in iteration order. Cost: O(len)."""
        prev, nxt = self.prev, self.next
        sentinel = self.sentinel
        tail = prev[sentinel]
        count = 0
        for block in blocks:
            nxt[tail] = block
            prev[block] = tail
            tail = block
            count += 1
        nxt[tail] = sentinel
        prev[sentinel] = tail
        self.size += count

    def push_front(self, blocks: Iterable[int]) -> None:
        """Insert ``blocks`` before the front as one batch in iteration
        order, so the first of them becomes the new front. Cost: O(len)."""
        prev, nxt = self.prev, self.next
        sentinel = self.sentinel
        old_front = nxt[sentinel]
        last = sentinel
        count = 0
        for block in blocks:
            nxt[last] = block
            prev[block] = last
            last = block
            count += 1
        nxt[last] = old_front
        prev[old_front] = last
        self.size += count

    def to_list(self) -> list[int]:
        """The queued ids, front first. Cost: O(len)."""
        nxt = self.next
        sentinel = self.sentinel
        out: list[int] = []
        block = nxt[sentinel]
        while block != sentinel:
            out.append(block)
            block = nxt[block]
        return out

    def walk(self, limit: int) -> list[int]:
        """The queued ids front first, at most ``limit`` of them, stopping at
        an id out of range: a ring that an interrupted change left broken may
        loop (recovery reads it this way). Cost: O(limit)."""
        nxt = self.next
        out: list[int] = []
        block = nxt[self.sentinel]
        while block != self.sentinel and 0 <= block < self.sentinel and len(out) < limit:
            out.append(block)
            block = nxt[block]
        return out

    def reset(self, order: Iterable[int]) -> None:
        """Hold exactly ``order`` (distinct ids), rebuilt in place: closures
        and views keep the same lists. Cost: O(num_blocks)."""
        sentinel = self.sentinel
        self.prev[:] = [sentinel] * len(self.prev)
        self.next[:] = [sentinel] * len(self.next)
        self.size = 0
        self.push_back(order)

    def check(self) -> None:
        """Assert the ring is consistent: forward and backward walks agree
        with each other and with ``size``. Cost: O(len).

        Raises:
            AssertionError: the links are broken.
        """
        forward = self.to_list()
        assert len(forward) == self.size, (forward, self.size)
        assert len(set(forward)) == len(forward), forward
        backward: list[int] = []
        block = self.prev[self.sentinel]
        while block != self.sentinel and len(backward) <= self.size:
            backward.append(block)
            block = self.prev[block]
        assert backward[::-1] == forward, (forward, backward)
