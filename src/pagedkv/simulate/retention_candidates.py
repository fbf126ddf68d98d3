"""Online eviction policies tried against ``lru-freq`` and not chosen (D-RET-9).

Each reads only the past, and each could run in a pool (a victim among free
cached blocks, from per-block or per-key metadata); the measurement that
ranked them is ``bench/results/retention_policies.md``. They use the
simulator's model (:mod:`pagedkv.simulate.retention_policies`):

- :class:`ScaledAge`: a FIFO per frequency level; the victim is the head of
  largest ``age / base**level`` (ages scale, rather than shift, with the
  level: what a heavy-tailed reuse gap suggests);
- :class:`GroupFreq`: ``lru-freq`` where the blocks of a request that adds few
  new blocks (a short follow-up turn) rank one level higher;
- :class:`ReuseDistance`: the deadline is the release plus the key's last
  reuse distance (capped), plus an optional ``lru-freq`` extension;
- :class:`SizeAware`: the deadline is extended for the blocks of short
  requests (short chains are continued more often on the conversation trace).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from pagedkv.simulate.retention_policies import ChainShape, KeyedPolicy, Policy, freq_level

__all__ = ["ScaledAge", "GroupFreq", "ReuseDistance", "SizeAware"]


def _count(memory: OrderedDict[int, int], block: int, limit: int) -> int:
    """One more release of ``block`` in a memory of the last ``limit`` blocks released."""
    releases = memory.pop(block, 0) + 1
    memory[block] = releases
    if len(memory) > limit:
        memory.popitem(last=False)
    return releases


class ScaledAge(Policy):
    """A FIFO per frequency level (releases remembered as ``lru-freq`` does);
    the victim is the level head of largest ``age / base**level``, the age in
    releases. Not a fixed key (the order of two heads changes with time), but
    four heads to compare: O(1)."""

    def __init__(self, capacity: int, shape: ChainShape, base: float) -> None:
        super().__init__(capacity, shape)
        self.name = f"scaled-age-{base:g}"
        self.base = base
        self.queues: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(4)]
        self.level: dict[int, int] = {}
        self.memory: OrderedDict[int, int] = OrderedDict()
        self.sequence = 0

    def _on_hit(self, block: int) -> None:
        level = self.level.pop(block, None)
        if level is not None:
            del self.queues[level][block]

    def _on_release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.sequence += 1
            level = freq_level(_count(self.memory, block, 2 * self.capacity))
            self.level[block] = level
            self.queues[level][block] = self.sequence

    def _victim(self, incoming: int) -> int:
        best, chosen = -1.0, 0
        for level, queue in enumerate(self.queues):
            if queue:
                released = next(iter(queue.values()))
                age = (self.sequence - released) / self.base ** level
                if age > best:
                    best, chosen = age, level
        block, _ = self.queues[chosen].popitem(last=False)
        del self.level[block]
        return block


class GroupFreq(KeyedPolicy):
    """``lru-freq`` (extension 0.75) where the blocks of a release that holds
    at most ``small`` blocks released for the first time rank a level higher."""

    def __init__(self, capacity: int, shape: ChainShape, small: int) -> None:
        super().__init__(capacity, shape, f"lru-freq+short-turn-{small}", self._key, leaf_only=False)
        self.small = small
        self.new_blocks = 0

    def _key(self, policy: KeyedPolicy, block: int) -> float:
        level = freq_level(self.released[block])
        if self.new_blocks <= self.small:
            level = min(level + 1, 3)
        return self.sequence + 0.75 * self.capacity * level

    def _on_release(self, blocks: Sequence[int]) -> None:
        self.new_blocks = sum(1 for block in blocks if block not in self.released)
        super()._on_release(blocks)


class ReuseDistance(KeyedPolicy):
    """Deadline = release + min(``alpha`` x the key's last reuse distance,
    ``cap`` x capacity) + ``extension`` x capacity x its frequency level
    (distances in releases; a key released once has distance 0)."""

    def __init__(self, capacity: int, shape: ChainShape, alpha: float, cap: float, extension: float) -> None:
        super().__init__(capacity, shape, f"reuse-distance-{alpha:g}-{cap:g}-{extension:g}", self._key,
                         leaf_only=False)
        self.alpha, self.cap, self.extension = alpha, cap, extension
        self.last: OrderedDict[int, int] = OrderedDict()

    def _key(self, policy: KeyedPolicy, block: int) -> float:
        previous = self.last.pop(block, None)
        distance = 0 if previous is None else self.sequence - previous
        self.last[block] = self.sequence
        if len(self.last) > 2 * self.capacity:
            self.last.popitem(last=False)
        level = freq_level(self.released[block])
        return (self.sequence + min(self.alpha * distance, self.cap * self.capacity)
                + self.extension * self.capacity * level)


class SizeAware(KeyedPolicy):
    """Deadline = release + ``alpha`` x capacity x log2(64 / request blocks),
    at least 0: a request of 4 blocks keeps its blocks 4 x ``alpha`` pools of
    releases longer than one of 64 or more."""

    def __init__(self, capacity: int, shape: ChainShape, alpha: float) -> None:
        super().__init__(capacity, shape, f"size-aware-{alpha:g}", self._key, leaf_only=False)
        self.alpha = alpha
        self.group = 1

    def _key(self, policy: KeyedPolicy, block: int) -> float:
        return self.sequence + self.alpha * self.capacity * max(0.0, math.log2(64 / max(self.group, 1)))

    def _on_release(self, blocks: Sequence[int]) -> None:
        self.group = len(blocks)
        super()._on_release(blocks)
