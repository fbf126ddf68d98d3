"""The arithmetic of retention (spec/retention.md), as pure functions with
PEP 316 contracts that CrossHair checks (``make crosshair``).

``reference/features/retention.py`` calls these instead of restating them,
so the contracts cover the decisions it makes: the pin budget in blocks
(RET-6), when a priority has decayed (RET-3), the maximum rule of two
directives (RET-2), the victim order (RET-4) and ``lru-freq``'s level,
deadline and victim order (RET-11).
"""

from __future__ import annotations

import math

__all__ = ["budget_blocks", "decayed", "merged_record", "victim_order", "freq_level", "freq_deadline",
           "freq_victim_order"]


def budget_blocks(budget: float, usable_blocks: int) -> int:
    """Blocks pins may hold: the floor of ``budget`` of the usable pool, so
    at least ``(1 - budget)`` of it is never pinned (RET-6, RET-7).

    pre: 0.0 <= budget <= 1.0
    pre: usable_blocks >= 0
    post: 0 <= __return__ <= usable_blocks
    post: __return__ <= budget * usable_blocks
    post: usable_blocks - __return__ >= usable_blocks - budget * usable_blocks
    """
    return min(usable_blocks, math.floor(budget * usable_blocks))


def decayed(released_at: float, duration: float | None, now: float) -> bool:
    """Whether a free block's priority, released at ``released_at`` with
    ``duration`` (``None``: forever), has ended at ``now`` (RET-3): it lasts
    the half-open interval ``[released_at, released_at + duration)``.

    pre: released_at <= now
    pre: duration is None or duration >= 0.0
    post: duration is not None or not __return__
    post: duration is None or __return__ == (now >= released_at + duration)
    """
    return duration is not None and now >= released_at + duration


def merged_record(old: tuple[int, float | None] | None, priority: int,
                  duration: float | None) -> tuple[int, float | None]:
    """A block's ``(priority, duration)`` after another directive (RET-2):
    the higher priority wins, never demoted; at equal priority the longer
    duration (``None`` = forever) wins. The first directive sets it.

    pre: 0 <= priority <= 100
    pre: old is None or 0 <= old[0] <= 100
    post: old is not None or __return__ == (priority, duration)
    post: old is None or __return__[0] == max(old[0], priority)
    post: old is None or __return__ in (old, (priority, duration))
    """
    if old is None or priority > old[0]:
        return (priority, duration)
    if priority < old[0]:
        return old
    longer = None if old[1] is None or duration is None else max(old[1], duration)
    return (priority, longer)


def victim_order(priorities: list[int]) -> list[int]:
    """Indices of free blocks (given in free-queue order) in eviction order
    (RET-4): lowest effective priority first, earliest in the queue (least
    recently freed) first among equals.

    post: sorted(__return__) == list(range(len(priorities)))
    post: all((priorities[a], a) < (priorities[b], b) for a, b in zip(__return__, __return__[1:]))
    """
    return sorted(range(len(priorities)), key=lambda index: (priorities[index], index))


def freq_level(releases: int, levels: int) -> int:
    """``lru-freq``'s level of a key released ``releases`` times (RET-11):
    ``floor(log2(releases))``, at most ``levels - 1`` (1, 2-3, 4-7, 8+ for
    4 levels): each doubling of the releases is one more level.

    pre: releases >= 1
    pre: levels >= 1
    post: 0 <= __return__ <= levels - 1
    post: __return__ == levels - 1 or 2 ** __return__ <= releases < 2 ** (__return__ + 1)
    """
    return min(releases.bit_length() - 1, levels - 1)


def freq_deadline(tick: int, level: int, usable_blocks: int, extension: tuple[int, int]) -> int:
    """``lru-freq``'s deadline of a released block (RET-11): its release tick
    plus ``extension`` (a fraction) of the usable pool per level, so a block
    released twice outlives a block released once by about that many releases.

    pre: tick >= 0 and level >= 0 and usable_blocks >= 0
    pre: extension[0] >= 0 and extension[1] >= 1
    post: __return__ >= tick
    post: level != 0 or __return__ == tick
    """
    return tick + level * (usable_blocks * extension[0] // extension[1])


def freq_victim_order(keys: list[int | None]) -> list[int]:
    """Indices of free blocks (given in free-queue order) in ``lru-freq``'s
    eviction order (RET-11): unkeyed blocks (``None``: nothing to retain)
    first, in queue order; then the least deadline; the earliest in the
    queue among equals.

    post: sorted(__return__) == list(range(len(keys)))
    post: all(keys[a] is None or keys[b] is not None for a, b in zip(__return__, __return__[1:]))
    post: all(None in (keys[a], keys[b]) or (keys[a], a) < (keys[b], b) for a, b in zip(__return__, __return__[1:]))
    post: all(a < b for a, b in zip(__return__, __return__[1:]) if keys[a] is None and keys[b] is None)
    """
    def key(index: int) -> tuple[int, int, int]:
        deadline = keys[index]
        return (0, 0, index) if deadline is None else (1, deadline, index)
    return sorted(range(len(keys)), key=key)
