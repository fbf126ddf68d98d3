"""Eviction policies for the prefix-cache retention study (:mod:`pagedkv.simulate.retention_model`).

Semantic model. A cache holds at most ``capacity`` blocks, each named by its
block id. A block id stands for the block *and* its whole prefix (as in the
Mooncake traces), so every block but a chain's first has exactly one parent,
the block before it, and a request's prompt is a chain of ids. A request
runs in three steps, driven by :func:`pagedkv.simulate.retention_model.simulate`:

1. :meth:`Policy.hit` for each of its blocks already resident;
2. :meth:`Policy.admit` for each missing block, in chain order: the block
   becomes resident, and when the cache is full the policy first evicts one
   victim (returned);
3. :meth:`Policy.release` with the request's blocks *tail first*: vLLM frees
   a request's blocks in reverse order, so its free queue holds a chain's
   tail ahead of its prefix.

From step 1 to step 3 the request's blocks are *pinned*: never a victim
(they are in use, as blocks of a running request are in vLLM). Every policy
picks its victim among resident, unpinned blocks; the base class keeps the
shared bookkeeping (resident set, pins, how many resident children each
block has) and counts *orphaning* evictions: a victim with a resident child,
which leaves that child (and its subtree) unreachable by a prefix lookup.

Two families:

- :class:`KeyedPolicy`: each released block gets a key; the victim is the
  evictable block of least key (a lazy min-heap, O(log n) per eviction).
  With ``leaf_only`` only blocks without resident children are candidates, so
  the cache stays prefix-closed. LRU, LRU-2, LFU with dynamic aging, GDSF
  and Belady's MIN are keys; so are priorities (the key's first field) and
  pins (a pinned-for-good block is never a candidate).
- Queue policies with their own structure: :class:`VllmLru` (vLLM's free
  queue, exactly), :class:`S3Fifo` and :class:`Arc`.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

__all__ = ["Policy", "KeyedPolicy", "VllmLru", "S3Fifo", "Arc", "ChainShape", "key_lru", "key_lru2",
           "key_lfu", "key_lru_freq", "lru_freq_key", "freq_level", "key_reuse_oracle", "key_gdsf", "key_min"]

# A block's key in a KeyedPolicy: (priority, primary, release sequence); least goes first.
Key = tuple[int, float, int]


class ChainShape:
    """The static shape of a trace's chains: each block's parent (-1 for a
    chain's first block), children and depth (0 for a first block), and, for
    the offline policy, the request indexes that use each block."""

    def __init__(self, chains: Sequence[Sequence[int]]) -> None:
        self.parent: dict[int, int] = {}
        self.children: dict[int, list[int]] = {}
        self.depth: dict[int, int] = {}
        self.uses: dict[int, list[int]] = {}
        for index, chain in enumerate(chains):
            previous = -1
            for depth, block in enumerate(chain):
                if block not in self.parent:
                    self.parent[block] = previous
                    self.depth[block] = depth
                    if previous >= 0:
                        self.children.setdefault(previous, []).append(block)
                elif self.parent[block] != previous:
                    raise ValueError(f"chains: block {block} has parents {self.parent[block]} "
                                     f"and {previous}; an id must stand for one prefix")
                self.uses.setdefault(block, []).append(index)
                previous = block

    def next_use(self, block: int, after: int) -> float:
        """The first request index past ``after`` that uses ``block``; inf when none."""
        uses = self.uses[block]
        position = bisect_right(uses, after)
        return uses[position] if position < len(uses) else math.inf


class Policy:
    """A cache of ``capacity`` blocks with one eviction rule (subclasses).
    ``now`` is the index of the running request, set by the simulator."""

    name = "policy"

    def __init__(self, capacity: int, shape: ChainShape) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self.shape = shape
        self.resident: set[int] = set()
        self.pinned: set[int] = set()
        self.kids: dict[int, int] = {}  # resident block -> how many of its children are resident
        self.now = 0
        self.evictions = 0
        self.orphaned = 0

    def hit(self, block: int) -> None:
        """``block`` (resident) is used by the running request: pinned until release."""
        self.pinned.add(block)
        self._on_hit(block)

    def admit(self, block: int) -> int | None:
        """Make ``block`` (not resident) resident and pinned; return the victim
        evicted to make room, or None. The caller keeps fewer than ``capacity``
        blocks pinned, so a victim always exists."""
        victim = self._make_room(block)
        if victim is not None:
            self._forget(victim)
        self.resident.add(block)
        self.pinned.add(block)
        parent = self.shape.parent[block]
        if parent in self.resident:
            self.kids[parent] += 1
        self.kids[block] = sum(1 for c in self.shape.children.get(block, ()) if c in self.resident)
        self._on_admit(block)
        return victim

    def release(self, blocks: Sequence[int]) -> None:
        """The running request is done; ``blocks`` (tail first) become evictable."""
        self.pinned.difference_update(blocks)
        self._on_release(blocks)

    def _forget(self, victim: int) -> None:
        assert victim in self.resident and victim not in self.pinned, victim
        self.evictions += 1
        self.resident.discard(victim)
        if self.kids.pop(victim):
            self.orphaned += 1
        parent = self.shape.parent[victim]
        if parent in self.resident:
            self.kids[parent] -= 1
            if self.kids[parent] == 0 and parent not in self.pinned:
                self._on_leaf(parent)

    def _make_room(self, incoming: int) -> int | None:
        """Evict (from the policy's own structures) and return a victim when full."""
        return self._victim(incoming) if len(self.resident) >= self.capacity else None

    def _victim(self, incoming: int) -> int:
        raise NotImplementedError

    def _on_hit(self, block: int) -> None:
        pass

    def _on_admit(self, block: int) -> None:
        pass

    def _on_release(self, blocks: Sequence[int]) -> None:
        pass

    def _on_leaf(self, block: int) -> None:
        """``block`` (resident, unpinned) just lost its last resident child."""


class VllmLru(Policy):
    """vLLM's order, exactly: one free queue, least recently freed first; a
    hit takes the block out of the queue, a release appends the request's
    blocks tail first. O(1) per operation."""

    name = "lru"

    def __init__(self, capacity: int, shape: ChainShape) -> None:
        super().__init__(capacity, shape)
        self.queue: OrderedDict[int, None] = OrderedDict()

    def _on_hit(self, block: int) -> None:
        del self.queue[block]

    def _on_release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.queue[block] = None

    def _victim(self, incoming: int) -> int:
        return self.queue.popitem(last=False)[0]


# A key function: (policy, block) -> primary key (least evicted first); it may read
# policy.sequence, the release sequence the block is about to get.
KeyFn = Callable[["KeyedPolicy", int], float]


def key_lru(policy: KeyedPolicy, block: int) -> float:
    """LRU: the release sequence alone decides (primary 0)."""
    return 0.0


def key_lru2(policy: KeyedPolicy, block: int) -> float:
    """LRU-2: the penultimate access (request index); -1 for a block used once."""
    return float(policy.history.get(block, (-1, -1))[0])


def key_lfu(policy: KeyedPolicy, block: int) -> float:
    """LFU with dynamic aging (LFU-DA): the aging floor plus the use count."""
    return policy.floor + policy.count[block]


def key_gdsf(policy: KeyedPolicy, block: int) -> float:
    """GDSF, cost = prefill compute a hit saves: the floor plus uses x cost,
    cost = 1 + depth/60 (a block's linear layers plus its attention over the
    ``depth`` blocks before it; attention is ~1/60 of an 8B model's per-token
    FLOPs per 512 tokens of context)."""
    return policy.floor + policy.count[block] * (1.0 + policy.shape.depth[block] / 60.0)


def freq_level(releases: int, levels: int = 4) -> int:
    """A block's frequency level: ``floor(log2(releases))`` capped at
    ``levels - 1`` (4 levels: 1, 2-3, 4-7, 8+ releases). The pools'
    ``lru-freq`` (spec/retention.md, RET-11) uses the same rule."""
    return min(releases.bit_length() - 1, levels - 1)


def lru_freq_key(extension: float, levels: int = 4) -> KeyFn:
    """LRU with frequency-extended deadlines: the release sequence plus
    ``extension`` x capacity per frequency level (:func:`freq_level` of the
    block's releases). Releases are counted across evictions for the last
    2 x capacity hashes released (``KeyedPolicy.released``): a block evicted
    and computed again keeps its record. With a few levels each level's keys
    arrive in release order, so a FIFO per level and a look at the heads
    evict in O(1). It is the pools' ``lru-freq`` exactly (one request at a
    time, so a use is a release)."""
    def key(policy: KeyedPolicy, block: int) -> float:
        return policy.sequence + extension * policy.capacity * freq_level(policy.released[block], levels)
    return key


key_lru_freq = lru_freq_key(0.75)


def key_reuse_oracle(policy: KeyedPolicy, block: int) -> float:
    """A diagnostic, offline: LRU that knows *whether* a block is used again
    (never-again blocks go first), not *when*: how much a perfect reuse
    classifier could win."""
    return 0.0 if math.isinf(policy.shape.next_use(block, policy.now)) else 1.0


def key_min(policy: KeyedPolicy, block: int) -> float:
    """Belady's MIN: the farthest next use goes first (offline: reads the future)."""
    return -policy.shape.next_use(block, policy.now)


class KeyedPolicy(Policy):
    """Evict the evictable block of least key ``(priority, key_fn, release
    sequence)``; the release sequence breaks ties in vLLM's order (least
    recently freed, a chain's tail first). Keys are fixed at release (a block's
    key changes only when it is used, and then it is pinned), so a lazy min-heap
    serves: O(log n) per release and per eviction, stale entries skipped.

    ``priority`` maps a block to its retention priority (default 35, least
    evicted first); ``pins`` are never evicted. With ``leaf_only`` only blocks
    without resident children are candidates (a parent is pushed again when
    its last resident child goes)."""

    def __init__(self, capacity: int, shape: ChainShape, name: str, key_fn: KeyFn, *,
                 leaf_only: bool, priority: Mapping[int, int] | None = None,
                 pins: frozenset[int] = frozenset()) -> None:
        super().__init__(capacity, shape)
        self.name = name
        self.key_fn = key_fn
        self.leaf_only = leaf_only
        self.priority: Mapping[int, int] = priority or {}
        self.pins = pins
        self.heap: list[tuple[int, float, int, int]] = []
        self.entry: dict[int, Key] = {}  # evictable block -> its key
        self.sequence = 0
        self.floor = 0.0  # LFU-DA / GDSF aging: the key of the last victim
        self.count: dict[int, int] = {}  # resident block -> uses since admission
        self.history: dict[int, tuple[int, int]] = {}  # block -> (penultimate, last) use
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # evicted blocks keeping history
        # Releases of the last 2 x capacity hashes released, resident or not (lru-freq's record).
        self.released: OrderedDict[int, int] = OrderedDict()

    def _use(self, block: int) -> None:
        self.count[block] = self.count.get(block, 0) + 1
        last = self.history.get(block, (-1, -1))[1]
        if last != self.now:
            self.history[block] = (last, self.now)

    def _on_hit(self, block: int) -> None:
        self.entry.pop(block, None)
        self._use(block)

    def _on_admit(self, block: int) -> None:
        self.ghosts.pop(block, None)
        self._use(block)

    def _on_release(self, blocks: Sequence[int]) -> None:
        released = self.released
        for block in blocks:
            self.sequence += 1
            released[block] = released.get(block, 0) + 1
            released.move_to_end(block)
            if len(released) > 2 * self.capacity:
                released.popitem(last=False)
            key = (self.priority.get(block, 35), self.key_fn(self, block), self.sequence)
            self.entry[block] = key
            if self._candidate(block):
                heapq.heappush(self.heap, (*key, block))

    def _candidate(self, block: int) -> bool:
        return block not in self.pins and not (self.leaf_only and self.kids[block])

    def _on_leaf(self, block: int) -> None:
        key = self.entry.get(block)
        if key is not None and self.leaf_only and block not in self.pins:
            heapq.heappush(self.heap, (*key, block))

    def _victim(self, incoming: int) -> int:
        heap, entry = self.heap, self.entry
        while heap:
            priority, primary, sequence, block = heapq.heappop(heap)
            key = entry.get(block)
            if key is None or key[2] != sequence or not self._candidate(block):
                continue  # stale: used since, evicted, or (leaf_only) a parent again
            del entry[block]
            del self.count[block]
            self.floor = max(self.floor, primary) if math.isfinite(primary) else self.floor
            # Keep the history of the last `capacity` victims (LRU-2's retained information).
            self.ghosts[block] = None
            if len(self.ghosts) > self.capacity:
                self.history.pop(self.ghosts.popitem(last=False)[0], None)
            return block
        raise RuntimeError(f"{self.name}: no evictable block (all {len(self.resident)} pinned)")


class S3Fifo(Policy):
    """S3-FIFO (Yang et al., SOSP '23): a small FIFO (10% of the capacity)
    takes new blocks; one used again before it reaches the small queue's head
    moves to the main FIFO, else it is evicted and its id kept in a ghost FIFO
    (as large as the main queue); a block admitted while its id is a ghost goes
    straight to main. Main is a CLOCK with a 2-bit use count. Blocks enter the
    queues at release, tail first. O(1) amortised per eviction."""

    name = "s3fifo"

    def __init__(self, capacity: int, shape: ChainShape) -> None:
        super().__init__(capacity, shape)
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}
        self.small_target = max(1, capacity // 10)
        self.ghost_limit = max(1, capacity - self.small_target)
        self.fresh: dict[int, bool] = {}  # admitted by the running request -> was a ghost

    def _on_hit(self, block: int) -> None:
        self.freq[block] = min(self.freq[block] + 1, 3)

    def _on_admit(self, block: int) -> None:
        self.freq[block] = 0
        was_ghost = block in self.ghost
        if was_ghost:
            del self.ghost[block]
        self.fresh[block] = was_ghost

    def _on_release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block in self.fresh:
                (self.main if self.fresh[block] else self.small)[block] = None
        self.fresh.clear()

    def _victim(self, incoming: int) -> int:
        while True:
            if self.small and (len(self.small) >= self.small_target or not self._main_has_victim()):
                block = self.small.popitem(last=False)[0]
                if self.freq[block] > 0 or block in self.pinned:
                    self.freq[block] = 0
                    self.main[block] = None
                    continue
                self.ghost[block] = None
                if len(self.ghost) > self.ghost_limit:
                    self.ghost.popitem(last=False)
                del self.freq[block]
                return block
            # A bounded CLOCK pass over main: every count drops to 0 within four turns.
            for _ in range(4 * len(self.main) + 1 if self.main else 0):
                block = self.main.popitem(last=False)[0]
                if block in self.pinned or self.freq[block] > 0:
                    self.freq[block] = max(self.freq[block] - 1, 0)
                    self.main[block] = None
                    continue
                del self.freq[block]
                return block
            raise RuntimeError("s3fifo: no evictable block")

    def _main_has_victim(self) -> bool:
        return any(block not in self.pinned for block in self.main)


class Arc(Policy):
    """ARC (Megiddo and Modha, FAST '03): T1 holds blocks used once, T2 blocks
    used again, B1/B2 the ids last evicted from each; a ghost hit moves the
    target size ``p`` of T1. Pinned blocks are skipped when a list's LRU end is
    taken. A released request's blocks move to their list's MRU end tail first.
    O(1) per operation."""

    name = "arc"

    def __init__(self, capacity: int, shape: ChainShape) -> None:
        super().__init__(capacity, shape)
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0

    def _on_hit(self, block: int) -> None:
        if block in self.t1:
            del self.t1[block]
        self.t2[block] = None
        self.t2.move_to_end(block)

    def _on_release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            (self.t1 if block in self.t1 else self.t2).move_to_end(block)

    def _make_room(self, incoming: int) -> int | None:
        c, full = self.capacity, len(self.resident) >= self.capacity
        victim: int | None = None
        if incoming in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            victim = self._replace(incoming) if full else None
            del self.b1[incoming]
            self.t2[incoming] = None
            return victim
        if incoming in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            victim = self._replace(incoming) if full else None
            del self.b2[incoming]
            self.t2[incoming] = None
            return victim
        if len(self.t1) + len(self.b1) >= c:
            if self.b1:
                self.b1.popitem(last=False)
                victim = self._replace(incoming) if full else None
            elif full:
                victim = self._take(self.t1, None)
                if victim is None:
                    victim = self._take(self.t2, self.b2)
        elif full or len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= c:
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
                self.b2.popitem(last=False)
            victim = self._replace(incoming) if full else None
        self.t1[incoming] = None
        return victim

    def _replace(self, incoming: int) -> int:
        t1_first = bool(self.t1) and (len(self.t1) > self.p
                                      or (incoming in self.b2 and len(self.t1) == self.p))
        order = [(self.t1, self.b1), (self.t2, self.b2)]
        for queue, ghosts in order if t1_first else order[::-1]:
            victim = self._take(queue, ghosts)
            if victim is not None:
                return victim
        raise RuntimeError("arc: no evictable block")

    def _take(self, queue: OrderedDict[int, None], ghosts: OrderedDict[int, None] | None,
              ) -> int | None:
        """The least recently used unpinned block of ``queue``, moved to ``ghosts``."""
        for block in queue:
            if block not in self.pinned:
                del queue[block]
                if ghosts is not None:
                    ghosts[block] = None
                return block
        return None
