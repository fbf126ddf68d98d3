"""Retention control, fast (spec/retention.md).

Semantic model: as ``reference/features/retention.py``: the block pool plus
per-block ``(priority, duration)`` records, release times, pins with TTLs and
tenants, per-tenant quotas; the victim is the free, unpinned block of lowest
effective priority, earliest in the free queue among equals (RET-4), or under
``lru-freq`` of least deadline, unkeyed blocks first (RET-11).

Representation: the ranked set of free unpinned blocks (per-level heaps, a
bitmap of non-empty levels, per-tenant heaps, ``lru-freq``'s release memory)
is :class:`~pagedkv.optimized.pool.retention_ranks.RankedFreePool`, this
class's base. Here:

- ``_timers``: one heap of ``(time, kind, block, stamp)`` for priority
  decays and pin expiries; a stale timer (its stamp no longer matches) is
  dropped when popped. Settling at time ``t`` pops what is due: O(log n) each.
- per block the record ``(priority, duration)``, release time and a stamp
  bumped on every acquire/release (stale decay timers); pins, tenants, quotas.

The seam: :class:`RetentionBlockPool` subclasses (through its ranked set) the kernel's pool, whose
code stays untouched; the chosen victims are moved to the front of the free
queue and the kernel's own (native) pop takes them. A pool built without
this class (the default) never consults a policy and pays nothing.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from pagedkv.optimized.pool.retention_ranks import NONE as _NONE
from pagedkv.optimized.pool.retention_ranks import RankedFreePool
from pagedkv.spec.errors import (
    InvalidArgumentError,
    InvalidRetentionError,
    InvariantViolation,
    PinBudgetExceededError,
    PoolExhaustedError,
)
from pagedkv.spec.retention import (
    MAX_PRIORITY,
    Policy,
    check_pin_budget,
    check_policy,
    check_priority,
    check_quota,
    check_seconds,
)

__all__ = ["RetentionBlockPool", "check_retention"]

_DECAY, _PIN_END = 0, 1


class RetentionBlockPool(RankedFreePool):
    """The optimized pool with an eviction policy, pins and tenant quotas;
    the same API and observable behaviour as the reference's
    ``RetentionBlockPool`` (block ids are ints here)."""

    def __init__(self, num_blocks: int, enable_caching: bool, *, policy: Policy = "lru",
                 pin_budget: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 enable_kv_cache_events: bool = False, num_groups: int = 1) -> None:
        super().__init__(num_blocks, enable_caching, enable_kv_cache_events=enable_kv_cache_events,
                         num_groups=num_groups)
        self.policy: Policy = check_policy(policy)
        self.pin_budget = check_pin_budget(pin_budget)
        self.clock = clock
        self.now = clock()
        self._prio = [_NONE] * num_blocks  # record priority, -1: no record
        self._dur: list[float | None] = [None] * num_blocks
        self._released_at = [0.0] * num_blocks
        self._stamp = [0] * num_blocks  # bumped on every acquire/release: stale decay timers
        self.pins: dict[int, tuple[float | None, float | None]] = {}
        self.tenant: dict[int, str] = {}
        self.quotas: dict[str, int] = {}
        self._tenant_heap: dict[str, list[tuple[int, int, int]]] = {}
        self._tenant_count: dict[str, int] = {}
        self._timers: list[tuple[float, int, int, int]] = []
        self.pins_granted = self.pins_refused = self.quota_evictions = 0
        self._init_freq()
        # Passive while the policy is lru with no pin and no quota: the kernel's
        # queue front is then the victim (RET-1), so nothing is ranked and each
        # call costs the kernel's plus the clock; the first pin, quota or
        # priority policy ranks the queue once (O(n)) and stays active.
        self._active = policy != "lru"
        self._rebuild()

    # ---------------------------------------------------------------- time

    def settle(self) -> None:
        """Read the clock; pop due timers: pins end (RET-10), priorities of
        free blocks decay (RET-3); then enforce quotas (RET-8)."""
        now = self.clock()
        if now < self.now:
            raise InvariantViolation(f"RET-3: the clock went back from {self.now} to {now}")
        self.now = now
        timers = self._timers
        if not (timers and timers[0][0] <= now) and not self.quotas:
            return  # nothing due: the common case costs a clock read
        while timers and timers[0][0] <= now:
            when, kind, block, stamp = heapq.heappop(timers)
            if kind == _PIN_END:
                pin = self.pins.get(block)
                if pin is not None and pin[1] == when:
                    del self.pins[block]
                    if not self._ref[block] and block:
                        self._enter(block)
            elif self._stamp[block] == stamp and self._prio[block] >= 0 and not self._ref[block]:
                ranked = self._level[block] >= 0
                self._leave(block)
                self._prio[block] = _NONE
                if ranked:
                    self._enter(block)
        self._enforce_quotas()

    def _enforce_quotas(self) -> None:
        for tenant in sorted(self.quotas):
            quota = self.quotas[tenant]
            while self._tenant_count.get(tenant, 0) > quota:
                block = self._tenant_victim(tenant)
                self._leave(block)
                self._evict(block)
                self._forget(block)
                self._enter(block)
                self.quota_evictions += 1

    def _forget(self, block: int) -> None:
        """A block lost its key (it is unranked or held): nothing of it is kept."""
        self._prio[block] = _NONE
        self._dur[block] = None
        self.pins.pop(block, None)
        self.tenant.pop(block, None)

    # ------------------------------------------------ the kernel, with retention

    def get_num_free_blocks(self) -> int:
        """Free unpinned blocks (RET-7). O(1)."""
        return self._ranked if self._active else self._queue.size

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """The policy's victims, taken by the kernel's pop (RET-4, RET-5).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.
            PoolExhaustedError: fewer free unpinned blocks than asked for (no change).
        """
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.settle()
        if not self._active:
            taken = super().get_new_blocks(num_blocks)
            prio = self._prio
            for block in taken:
                if prio[block] >= 0 or block in self.tenant:
                    self._forget(block)
            return taken
        if num_blocks > self._ranked:
            raise PoolExhaustedError(
                f"asked for {num_blocks} blocks, only {self._ranked} are free and unpinned")
        victims = [self._pop_victim() for _ in range(num_blocks)]
        queue = self._queue
        for block in victims:
            queue.remove(block)
        queue.push_front(victims)
        taken = super().get_new_blocks(num_blocks)
        stamp = self._stamp
        for block in taken:
            self._forget(block)
            stamp[block] += 1
        return taken

    def touch_held(self, blocks: Iterable[int]) -> None:
        """The kernel's hit; a pinned block's TTL restarts (RET-10). Tenants
        never share a hit: their keys differ by ``cache_salt`` (RET-9)."""
        ids = list(blocks)
        self.settle()
        if not self._active:
            super().touch_held(ids)
            return
        for block in ids:
            pin = self.pins.get(block) if block else None
            if pin is not None and pin[0] is not None:
                self._pin_until(block, pin[0])
            if block and not self._ref[block]:
                self._leave(block)
                self._stamp[block] += 1
        super().touch_held(ids)

    def free_held(self, blocks: Iterable[int], *, with_null: bool = False) -> None:
        """The kernel's release; released blocks are numbered as the kernel
        queued them and ranked; their durations start now (RET-3)."""
        ids = list(blocks)
        self.settle()
        ref = self._ref
        released = [block for block in ids if block and ref[block] == 1]
        super().free_held(ids, with_null=with_null)
        if not self._active:
            self._released_passive(released)
            return
        front = [block for block in released if self._gid[block] < 0]
        self._front_seq -= len(front)
        for offset, block in enumerate(front):
            self._seq[block] = self._front_seq + offset
        for block in released:
            if self._gid[block] >= 0:
                self._seq[block] = self._back_seq
                self._back_seq += 1
        self._released(released)

    def release_to_back(self, blocks: Iterable[int]) -> None:
        """The kernel's release to the back (all released blocks numbered at the back)."""
        ids = list(blocks)
        self._check_ids(ids)
        if 0 in ids or len(set(ids)) != len(ids) or any(self._ref[b] < 1 for b in ids):
            super().release_to_back(ids)  # refused (POOL-3) before the clock is read
        self.settle()
        super().release_to_back(ids)
        released = [block for block in ids if not self._ref[block]]
        if not self._active:
            self._released_passive(released)
            return
        for block in released:
            self._seq[block] = self._back_seq
            self._back_seq += 1
        self._released(released)

    def _released(self, released: Sequence[int]) -> None:
        now = self.now
        if self.policy == "lru-freq":
            self._count_releases(released)
        for block in released:
            self._stamp[block] += 1
            self._released_at[block] = now
            duration = self._dur[block]
            if self._prio[block] >= 0 and duration is not None:
                heapq.heappush(self._timers, (now + duration, _DECAY, block, self._stamp[block]))
            if block not in self.pins:
                self._enter(block)
        self.settle()  # a zero duration ends at once

    def _released_passive(self, released: Sequence[int]) -> None:
        """Release bookkeeping while passive (policy lru): only records need a release time."""
        prio = self._prio
        for block in released:
            if prio[block] >= 0:
                self._stamp[block] += 1
                self._released_at[block] = self.now
                duration = self._dur[block]
                if duration is not None:
                    heapq.heappush(self._timers, (self.now + duration, _DECAY, block, self._stamp[block]))
        if self._timers:
            self.settle()  # a zero duration ends at once

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """The kernel's explicit eviction; an evicted block keeps nothing."""
        ids = list(block_ids)
        self._check_ids(ids)
        self.settle()
        keyed = [block for block in ids if block and self._gid[block] >= 0]
        for block in keyed:
            self._leave(block)
        super().evict_blocks(ids)
        for block in keyed:
            self._forget(block)
            if self._active and not self._ref[block]:
                self._leave(block)
                self._enter(block)

    def reset_prefix_cache(self) -> bool:
        """The kernel's reset; on success every record, pin and tenant goes."""
        self.settle()
        if not super().reset_prefix_cache():
            return False
        self._prio[:] = [_NONE] * self.num_blocks
        self._dur[:] = [None] * self.num_blocks
        self.pins.clear()
        self.tenant.clear()
        self._memory.clear()
        self._rebuild()
        return True

    def recover(self, holders: Mapping[int, int]) -> None:
        """The kernel's recovery, then a fresh numbering of its queue."""
        super().recover(holders)
        self._rebuild()

    # ------------------------------------------------------------ directives

    def retain(self, block_ids: Sequence[int], priority: int, duration: float | None = None,
               tenant: str | None = None) -> None:
        """Apply a directive to held blocks (RET-2); see the reference."""
        check_priority(priority)
        check_seconds(duration, "duration")
        ids = self._held_ids(block_ids)
        if tenant is not None:
            if type(tenant) is not str:
                raise InvalidRetentionError(f"tenant must be a str, got {tenant!r}")
            for block in ids:
                if self.tenant.get(block, tenant) != tenant:
                    raise InvalidRetentionError(
                        f"block_ids: block {block} belongs to tenant {self.tenant[block]!r}, not {tenant!r}")
        self.settle()
        prio, dur = self._prio, self._dur
        for block in ids:
            old = prio[block]
            if old < 0 or priority > old:  # RET-2: the higher priority wins, never demoted
                prio[block], dur[block] = priority, duration
            elif priority == old:
                dur[block] = None if dur[block] is None or duration is None else max(dur[block], duration)  # type: ignore[type-var]
            if tenant is not None:
                self.tenant[block] = tenant

    def pin_capacity(self) -> int:
        """Blocks pins may hold (RET-6)."""
        usable = self.num_blocks - 1
        return min(usable, math.floor(self.pin_budget * usable))

    def pin(self, block_ids: Sequence[int], ttl: float | None = None) -> None:
        """Pin keyed blocks, all or none (RET-6); see the reference."""
        check_seconds(ttl, "ttl")
        ids = self._block_ids(block_ids)
        for block in ids:
            if self._gid[block] < 0:
                raise InvalidRetentionError(f"block_ids: block {block} is not cached, nothing to pin")
        self.settle()
        self._activate()
        new = {block for block in ids if block not in self.pins}
        if len(self.pins) + len(new) > self.pin_capacity():
            self.pins_refused += 1
            raise PinBudgetExceededError(
                f"pinning {len(ids)} block(s) would hold {len(self.pins) + len(new)} pinned blocks, "
                f"the budget {self.pin_budget} allows {self.pin_capacity()}")
        for block in ids:
            self._leave(block)
            self._pin_until(block, ttl)
        self.pins_granted += 1

    def _pin_until(self, block: int, ttl: float | None) -> None:
        expiry = None if ttl is None else self.now + ttl
        self.pins[block] = (ttl, expiry)
        if expiry is not None:
            heapq.heappush(self._timers, (expiry, _PIN_END, block, 0))

    def unpin(self, block_ids: Sequence[int]) -> None:
        """End the pins of the given blocks (unpinned ones: no-op)."""
        ids = self._block_ids(block_ids)
        self.settle()
        for block in ids:
            if self.pins.pop(block, None) is not None and not self._ref[block]:
                self._enter(block)
        self.settle()

    def set_policy(self, policy: Policy) -> None:
        """Switch the policy; records are kept, every free block re-ranked. O(n log n).
        A switch to ``lru-freq`` starts its memory afresh (RET-11)."""
        policy = check_policy(policy)
        if policy == "lru-freq" and self.policy != "lru-freq":
            self._reset_freq()
        self.policy = policy
        self.settle()
        if not self._active:
            if policy == "lru":
                return
            self._activate()
            return
        seq = self._seq
        order = sorted((block for block in range(1, self.num_blocks) if not self._ref[block]),
                       key=lambda block: seq[block])
        for block in order:
            self._leave(block)
        self._levels = [[] for _ in range(MAX_PRIORITY + 1)]
        self._tenant_heap = {}
        for block in order:
            if block not in self.pins:
                self._enter(block)

    def set_tenant_quota(self, tenant: str, quota: int | None) -> None:
        """Cap the free cached blocks ``tenant`` keeps (``None``: no cap)."""
        if type(tenant) is not str:
            raise InvalidRetentionError(f"tenant must be a str, got {tenant!r}")
        check_quota(quota)
        if quota is None:
            self.quotas.pop(tenant, None)
        else:
            self._activate()
            self.quotas[tenant] = quota
        self.settle()

    def _block_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = list(block_ids)
        for block in ids:
            if type(block) is not int or not 1 <= block < self.num_blocks:
                raise InvalidRetentionError(f"block_ids: {block!r} is not a block id in [1, {self.num_blocks})")
        return ids

    def _held_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = self._block_ids(block_ids)
        for block in ids:
            if not self._ref[block]:
                raise InvalidRetentionError(f"block_ids: block {block} is free; directives apply to held blocks")
        return ids

    # ----------------------------------------------------------- observation

    def retention_state(self) -> tuple[object, ...]:
        """What lockstep compares (the reference's shape)."""
        records = [(b, (self._prio[b], self._dur[b])) for b in range(self.num_blocks) if self._prio[b] >= 0]
        free = self._queue.to_list()
        return (self.policy, records,
                sorted((b, self._released_at[b]) for b, _ in records if not self._ref[b]),
                sorted(self.pins.items()), sorted(self.tenant.items()), sorted(self.quotas.items()),
                (self.pins_granted, self.pins_refused, self.quota_evictions), self.tick,
                sorted(self._memory.values()),
                sorted((b, self.freq_deadline(b)) for b in free if self._gid[b] >= 0 and self.policy == "lru-freq"))


def check_retention(pool: RetentionBlockPool) -> None:
    """Raise :class:`InvariantViolation` naming the first broken RET rule;
    also checks the ranked set against a recount."""
    for block in pool.pins:
        if pool._gid[block] < 0:
            raise InvariantViolation(f"RET-5: pinned block {block} lost its key")
        if pool._level[block] >= 0:
            raise InvariantViolation(f"RET-5: pinned block {block} is ranked for eviction")
    if len(pool.pins) > pool.pin_capacity():
        raise InvariantViolation(f"RET-6: {len(pool.pins)} pinned blocks, budget {pool.pin_capacity()}")
    held = sum(1 for count in pool._ref[1:] if count)
    if pool.get_num_free_blocks() + held < pool.num_blocks - 1 - pool.pin_capacity():
        raise InvariantViolation(
            f"RET-7: {pool.get_num_free_blocks()} allocatable + {held} held < (1 - budget) of the pool")
    free = [b for b in range(1, pool.num_blocks) if not pool._ref[b] and b not in pool.pins]
    if pool._active and sorted(free) != sorted(b for b in range(pool.num_blocks) if pool._level[b] >= 0):
        raise InvariantViolation("RET-4: the ranked set is not the free unpinned blocks")
    for block in range(1, pool.num_blocks):
        if pool._prio[block] >= 0 and not pool._ref[block]:
            duration = pool._dur[block]
            if duration is not None and pool.now >= pool._released_at[block] + duration:
                raise InvariantViolation(f"RET-3: block {block}'s priority outlived its duration")
    for tenant, quota in pool.quotas.items():
        own = sum(1 for b in free if pool._gid[b] >= 0 and pool.tenant.get(b) == tenant)
        if own > quota:
            raise InvariantViolation(f"RET-8: tenant {tenant!r} keeps {own} free cached blocks, quota {quota}")
