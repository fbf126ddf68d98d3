"""Retention control, stated simply (spec/retention.md).

Semantic model: the kernel's :class:`~pagedkv.reference.block_pool.BlockPool`
plus, per block id, a retention *record* ``(priority, duration)``, the time
of its last release, a pin ``(ttl, expiry)`` and a tenant; per tenant a quota.
The victim of each allocation is found by scanning every free, unpinned block
for the minimum key ``(effective priority, position in the free queue)``
(RET-4); nothing here is fast on purpose.

The seam: :class:`RetentionBlockPool` subclasses the kernel's pool and leaves
its code untouched. Before the kernel pops ``n`` blocks from the front of the
free queue, the chosen victims are moved to that front, so the kernel's own
pop, eviction and events run unchanged. A pool built without this class (the
default) never consults a policy.

``lru-freq`` (RET-11): while it is the policy, the pool remembers, for the
last ``FREQ_MEMORY x (N - 1)`` keys released, how many times each was
released, and counts every keyed release with a tick; a released block keeps its tick and its key's
level, and the victim is the unkeyed block first, then the least deadline
``tick + level x extension``.

Time: every public call first *settles* at ``clock()`` (expired pins end,
expired priorities decay to the default, then tenant quotas are enforced);
state is read as of the last settle.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features.hisparse import release_to_back
from pagedkv.reference.features.retention_rules import (
    budget_blocks,
    decayed,
    freq_deadline,
    freq_level,
    freq_victim_order,
    merged_record,
    victim_order,
)
from pagedkv.spec.errors import (
    InvalidArgumentError,
    InvalidRetentionError,
    InvariantViolation,
    PinBudgetExceededError,
    PoolExhaustedError,
)
from pagedkv.spec.retention import (
    DEFAULT_PRIORITY,
    FREQ_EXTENSION,
    FREQ_LEVELS,
    FREQ_MEMORY,
    Policy,
    check_pin_budget,
    check_policy,
    check_priority,
    check_quota,
    check_seconds,
)

__all__ = ["RetentionBlockPool", "RetentionStats", "check_retention"]


class RetentionStats:
    """Counters a retention pool reports (observation only)."""

    def __init__(self) -> None:
        self.pins_granted = 0
        self.pins_refused = 0
        self.quota_evictions = 0

    def as_tuple(self) -> tuple[int, int, int]:
        """``(pins granted, pins refused, quota evictions)``."""
        return (self.pins_granted, self.pins_refused, self.quota_evictions)


class RetentionBlockPool(BlockPool):
    """The kernel pool with an eviction policy, pins and tenant quotas.

    Args:
        policy: ``"lru"`` (the kernel's order: every block id and event as
            without retention, RET-1), ``"priority"`` (RET-4) or
            ``"lru-freq"`` (RET-11).
        pin_budget: share of the usable pool pins may hold (0: pins off).
        clock: seconds, monotonic; injected so tests control time.

    Raises:
        InvalidRetentionError: ``policy`` or ``pin_budget`` malformed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, *, policy: Policy = "lru",
                 pin_budget: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 enable_kv_cache_events: bool = False, num_groups: int = 1) -> None:
        super().__init__(num_blocks, enable_caching, enable_kv_cache_events=enable_kv_cache_events,
                         num_groups=num_groups)
        self.policy: Policy = check_policy(policy)
        self.pin_budget = check_pin_budget(pin_budget)
        self.clock = clock
        self.now = clock()
        self.record: dict[int, tuple[int, float | None]] = {}  # block id -> (priority, duration)
        self.released_at: dict[int, float] = {}
        self.pins: dict[int, tuple[float | None, float | None]] = {}  # block id -> (ttl, expiry)
        self.tenant: dict[int, str] = {}
        self.quotas: dict[str, int] = {}
        self.stats = RetentionStats()
        # lru-freq (RET-11): releases per key, the most recently released keys last.
        self.release_memory: OrderedDict[object, int] = OrderedDict()
        self.tick = 0  # keyed releases so far
        self.freq: dict[int, tuple[int, int]] = {}  # block id -> (tick, level) of its last keyed release

    # -- reading -----------------------------------------------------------

    def is_pinned(self, block_id: int) -> bool:
        """Whether the block is pinned as of the last settle."""
        return block_id in self.pins

    def effective_priority(self, block: KVCacheBlock) -> int:
        """The rank of a block (RET-2, RET-3): its record's priority under
        ``priority`` while keyed, else the default. Under ``lru`` every block
        ranks alike, so the victims are the free queue's front (RET-1)."""
        if self.policy == "lru" or block.block_hash is None:
            return DEFAULT_PRIORITY
        return self.record.get(block.block_id, (DEFAULT_PRIORITY, None))[0]

    def allocatable(self) -> list[KVCacheBlock]:
        """Free, unpinned blocks in free-queue order."""
        return [block for block in self.free_queue if block.block_id not in self.pins]

    def get_num_free_blocks(self) -> int:
        """Free blocks an allocation can take: pinned free blocks excluded (RET-7)."""
        return len(self.allocatable())

    def pin_capacity(self) -> int:
        """How many blocks pins may hold at once (RET-6)."""
        return budget_blocks(self.pin_budget, self.num_blocks - 1)

    # -- time --------------------------------------------------------------

    def settle(self) -> None:
        """Read the clock; end expired pins (RET-10), decay expired
        priorities of free blocks (RET-3), enforce quotas (RET-8)."""
        now = self.clock()
        if now < self.now:
            raise InvariantViolation(f"RET-3: the clock went back from {self.now} to {now}")
        self.now = now
        for block_id, (_, expiry) in list(self.pins.items()):
            if expiry is not None and expiry <= now:
                del self.pins[block_id]
        for block in self.free_queue:
            record = self.record.get(block.block_id)
            if record is not None and decayed(self.released_at[block.block_id], record[1], now):
                del self.record[block.block_id]
        self._enforce_quotas()

    def _enforce_quotas(self) -> None:
        """Each tenant over its quota loses its own victims' keys, in victim
        order, until it keeps at most its quota (RET-8)."""
        for tenant in sorted(self.quotas):
            while True:
                own = [block for block in self.allocatable()
                       if block.block_hash is not None and self.tenant.get(block.block_id) == tenant]
                if len(own) <= self.quotas[tenant]:
                    break
                victim = self._ranked(own)[0]
                self._evict(victim)
                self._forget(victim.block_id)
                self.stats.quota_evictions += 1

    def _ranked(self, blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        """``blocks`` (free, in queue order) sorted by the policy's victim
        order (RET-4; under ``lru-freq``, RET-11)."""
        if self.policy == "lru-freq":
            order = freq_victim_order([self.freq_deadline(block) for block in blocks])
        else:
            order = victim_order([self.effective_priority(block) for block in blocks])
        return [blocks[index] for index in order]

    def freq_deadline(self, block: KVCacheBlock) -> int | None:
        """``lru-freq``'s deadline of a free block (RET-11): ``None`` when it
        is unkeyed (it goes first); a keyed block never released since the
        pool was built counts tick 0, level 0."""
        if block.block_hash is None:
            return None
        tick, level = self.freq.get(block.block_id, (0, 0))
        return freq_deadline(tick, level, self.num_blocks - 1, FREQ_EXTENSION)

    def _count_release(self, block: KVCacheBlock) -> None:
        """A keyed block was released: one more release of its key (the
        memory keeps the last ``FREQ_MEMORY x (N - 1)`` keys), the next tick."""
        key = block.block_hash
        releases = self.release_memory.pop(key, 0) + 1
        self.release_memory[key] = releases
        if len(self.release_memory) > FREQ_MEMORY * (self.num_blocks - 1):
            self.release_memory.popitem(last=False)
        self.tick += 1
        self.freq[block.block_id] = (self.tick, freq_level(releases, FREQ_LEVELS))

    def _forget(self, block_id: int) -> None:
        """A block lost its key: nothing of it is worth retaining."""
        self.record.pop(block_id, None)
        self.released_at.pop(block_id, None)
        self.pins.pop(block_id, None)
        self.tenant.pop(block_id, None)
        self.freq.pop(block_id, None)

    # -- the kernel's operations, with retention ------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """The kernel's allocation, popping the policy's victims (RET-4):
        pinned blocks are never taken (RET-5).

        Raises:
            PoolExhaustedError: fewer allocatable blocks than asked for (no change).
        """
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.settle()
        candidates = self.allocatable()
        if num_blocks > len(candidates):
            raise PoolExhaustedError(
                f"asked for {num_blocks} blocks, only {len(candidates)} are free and unpinned")
        victims = self._ranked(candidates)[:num_blocks]
        chosen = {id(block) for block in victims}
        self.free_queue = victims + [block for block in self.free_queue if id(block) not in chosen]
        taken = super().get_new_blocks(num_blocks)
        for block in taken:
            self._forget(block.block_id)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """The kernel's touch; a hit on a pinned block restarts its TTL (RET-10).
        Tenants never share a hit: their keys differ by ``cache_salt`` (RET-9)."""
        blocks = list(blocks)
        self.settle()
        for block in blocks:
            pin = self.pins.get(block.block_id)
            if pin is not None and pin[0] is not None:
                self.pins[block.block_id] = (pin[0], self.now + pin[0])
        super().touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """The kernel's free; each released block's duration starts now (RET-3)."""
        blocks = list(ordered_blocks)
        if any(block.ref_cnt < sum(1 for other in blocks if other is block) for block in blocks if not block.is_null):
            super().free_blocks(blocks)  # refused (POOL-3) before the clock is read: nothing changes
        self.settle()
        held = list(dict.fromkeys(block.block_id for block in blocks if block.ref_cnt > 0))
        super().free_blocks(blocks)
        self._released(held)

    def release_to_back(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """The host tier's release to the back (a pool function of the
        HiSparse feature); durations start now (RET-3)."""
        blocks = list(ordered_blocks)
        if any(b.is_null or b.ref_cnt < 1 for b in blocks) or len({id(b) for b in blocks}) != len(blocks):
            release_to_back(self, blocks)  # refused (POOL-3) before the clock is read
        self.settle()
        release_to_back(self, blocks)
        self._released([block.block_id for block in blocks])

    def _released(self, block_ids: Sequence[int]) -> None:
        """``block_ids`` (in release order) were held: those now free start
        their durations (RET-3) and, keyed, count a release (RET-11)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.released_at[block_id] = self.now
                if block.block_hash is not None and self.policy == "lru-freq":
                    self._count_release(block)
        self.settle()  # a zero duration ends at once

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """The kernel's explicit eviction; an evicted block keeps nothing (pins included)."""
        ids = list(block_ids)
        if any(type(block_id) is not int or not 0 <= block_id < self.num_blocks for block_id in ids):
            super().evict_blocks(ids)  # refused (UnknownBlockError) before the clock is read
        self.settle()
        keyed = [block_id for block_id in ids if block_id and self.blocks[block_id].block_hash is not None]
        super().evict_blocks(ids)
        for block_id in keyed:
            self._forget(block_id)

    def reset_prefix_cache(self) -> bool:
        """The kernel's reset; on success every record, pin and tenant goes."""
        self.settle()
        if not super().reset_prefix_cache():
            return False
        for block_id in range(self.num_blocks):
            self._forget(block_id)
        self.release_memory.clear()
        return True

    # -- directives ----------------------------------------------------------

    def retain(self, block_ids: Sequence[int], priority: int, duration: float | None = None,
               tenant: str | None = None) -> None:
        """Apply a directive to held blocks: each keeps the maximum priority
        (RET-2) and, given ``tenant``, belongs to it.

        Raises:
            InvalidRetentionError: a malformed field, a block not held, or a
                block of another tenant (no change).
        """
        check_priority(priority)
        check_seconds(duration, "duration")
        ids = self._held_ids(block_ids)
        if tenant is not None:
            if type(tenant) is not str:
                raise InvalidRetentionError(f"tenant must be a str, got {tenant!r}")
            for block_id in ids:
                if self.tenant.get(block_id, tenant) != tenant:
                    raise InvalidRetentionError(
                        f"block_ids: block {block_id} belongs to tenant {self.tenant[block_id]!r}, not {tenant!r}")
        self.settle()
        for block_id in ids:
            self.record[block_id] = merged_record(self.record.get(block_id), priority, duration)
            if tenant is not None:
                self.tenant[block_id] = tenant

    def pin(self, block_ids: Sequence[int], ttl: float | None = None) -> None:
        """Pin keyed blocks for ``ttl`` seconds (refreshed on hits), all or none.

        Raises:
            InvalidRetentionError: a malformed field or an unkeyed block.
            PinBudgetExceededError: the pins would pass the budget (RET-6).
        """
        check_seconds(ttl, "ttl")
        ids = self._block_ids(block_ids)
        for block_id in ids:
            if self.blocks[block_id].block_hash is None:
                raise InvalidRetentionError(f"block_ids: block {block_id} is not cached, nothing to pin")
        self.settle()
        wanted = set(self.pins) | set(ids)
        if len(wanted) > self.pin_capacity():
            self.stats.pins_refused += 1
            raise PinBudgetExceededError(
                f"pinning {len(ids)} block(s) would hold {len(wanted)} pinned blocks, the budget "
                f"{self.pin_budget} allows {self.pin_capacity()}")
        for block_id in ids:
            self.pins[block_id] = (ttl, None if ttl is None else self.now + ttl)
        self.stats.pins_granted += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        """End the pins of the given blocks (unpinned ones: no-op)."""
        ids = self._block_ids(block_ids)
        self.settle()
        for block_id in ids:
            self.pins.pop(block_id, None)
        self.settle()

    def set_policy(self, policy: Policy) -> None:
        """Switch the policy; records are kept. A switch to ``lru-freq``
        starts its memory afresh: every free keyed block at tick 0, level 0
        (RET-11)."""
        policy = check_policy(policy)
        if policy == "lru-freq" and self.policy != "lru-freq":
            self.release_memory.clear()
            self.freq.clear()
        self.policy = policy
        self.settle()

    def set_tenant_quota(self, tenant: str, quota: int | None) -> None:
        """Cap the free cached blocks ``tenant`` keeps (``None``: no cap)."""
        if type(tenant) is not str:
            raise InvalidRetentionError(f"tenant must be a str, got {tenant!r}")
        check_quota(quota)
        if quota is None:
            self.quotas.pop(tenant, None)
        else:
            self.quotas[tenant] = quota
        self.settle()

    def _block_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = list(block_ids)
        for block_id in ids:
            if type(block_id) is not int or not 1 <= block_id < self.num_blocks:
                raise InvalidRetentionError(f"block_ids: {block_id!r} is not a block id in [1, {self.num_blocks})")
        return ids

    def _held_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = self._block_ids(block_ids)
        for block_id in ids:
            if self.blocks[block_id].ref_cnt == 0:
                raise InvalidRetentionError(f"block_ids: block {block_id} is free; directives apply to held blocks")
        return ids

    # -- observation -----------------------------------------------------------

    def retention_state(self) -> tuple[object, ...]:
        """What lockstep compares: policy, records, release times of free
        recorded blocks, pins, tenants, quotas, stats; ``lru-freq``'s tick,
        the release counts it remembers and, under it, each free keyed block's
        deadline (under another policy deadlines are not kept up to date)."""
        return (self.policy, sorted(self.record.items()),
                sorted((b, t) for b, t in self.released_at.items()
                       if b in self.record and self.blocks[b].ref_cnt == 0),
                sorted(self.pins.items()), sorted(self.tenant.items()), sorted(self.quotas.items()),
                self.stats.as_tuple(), self.tick, sorted(self.release_memory.values()),
                sorted((block.block_id, self.freq_deadline(block)) for block in self.free_queue
                       if block.block_hash is not None and self.policy == "lru-freq"))


def check_retention(pool: RetentionBlockPool) -> None:
    """Raise :class:`InvariantViolation` naming the first broken RET rule."""
    for block_id in pool.pins:
        if pool.blocks[block_id].block_hash is None:
            raise InvariantViolation(f"RET-5: pinned block {block_id} lost its key")
    if len(pool.pins) > pool.pin_capacity():
        raise InvariantViolation(f"RET-6: {len(pool.pins)} pinned blocks, budget {pool.pin_capacity()}")
    held = sum(1 for block in pool.blocks[1:] if block.ref_cnt > 0)
    if pool.get_num_free_blocks() + held < pool.num_blocks - 1 - pool.pin_capacity():
        raise InvariantViolation(
            f"RET-7: {pool.get_num_free_blocks()} allocatable + {held} held < (1 - budget) of the pool")
    for block_id, (priority, _) in pool.record.items():
        if not 0 <= priority <= 100:
            raise InvariantViolation(f"RET-2: block {block_id} has priority {priority}")
        block = pool.blocks[block_id]
        if block.ref_cnt == 0 and decayed(pool.released_at[block_id], pool.record[block_id][1], pool.now):
            raise InvariantViolation(f"RET-3: block {block_id}'s priority outlived its duration")
    for tenant, quota in pool.quotas.items():
        own = sum(1 for block in pool.allocatable()
                  if block.block_hash is not None and pool.tenant.get(block.block_id) == tenant)
        if own > quota:
            raise InvariantViolation(f"RET-8: tenant {tenant!r} keeps {own} free cached blocks, quota {quota}")
