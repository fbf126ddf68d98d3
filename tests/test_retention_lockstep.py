"""Retention in lockstep: reference and optimized pools driven alike
(spec/retention.md: RET-1, RET-2, RET-3, RET-4, RET-5, RET-6, RET-7, RET-8,
RET-9, RET-10, RET-11).

A Hypothesis state machine draws allocations, caching, hits, frees,
directives, pins, unpins, quotas, clock advances, policy switches, explicit
evictions and resets; after every step both sides agree (result or error
type, snapshot with the free queue and events, retention state) and both
checkers pass. Scenario tests pin each rule down, and planted-bug gates show
the machinery catches a broken max rule, pin, budget, decay, quota and
``lru-freq`` order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.optimized.pool.block_pool import BlockPool as OptimizedKernel
from pagedkv.optimized.pool.retention import RetentionBlockPool as OptimizedPool
from pagedkv.reference.block_pool import BlockPool as ReferenceKernel
from pagedkv.reference.features.retention import RetentionBlockPool as ReferencePool
from pagedkv.spec.errors import InvalidRetentionError, PinBudgetExceededError
from pagedkv.spec.retention import POLICIES
from tests.retention_twins import BLOCK_SIZE, FakeRequest, RetentionTwins

TENANTS = ("acme", "zeta")


class RetentionLockstep(RuleBasedStateMachine):
    """Both retention pools under every retention operation."""

    def __init__(self) -> None:
        super().__init__()
        self.twins = RetentionTwins(1)
        self.counter = 0

    @initialize(num_blocks=st.integers(4, 14), policy=st.sampled_from(POLICIES),
                budget=st.sampled_from([0.0, 0.25, 0.5]))
    def build(self, num_blocks: int, policy: Any, budget: float) -> None:
        self.twins = RetentionTwins(num_blocks, policy=policy, pin_budget=budget)

    def _name(self) -> str:
        self.counter += 1
        return f"h{self.counter}"

    @rule(count=st.integers(0, 5), cache=st.booleans())
    def allocate(self, count: int, cache: bool) -> None:
        name = self._name()
        if self.twins.allocate(name, count) and cache and count:
            self.twins.cache(name)

    @precondition(lambda self: bool(self.twins.keyed()))
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        keyed = self.twins.keyed()
        ids = data.draw(st.lists(st.sampled_from(keyed), min_size=1, max_size=3, unique=True))
        self.twins.hit(self._name(), ids)

    @precondition(lambda self: bool(self.twins.holdings))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.twins.free(data.draw(st.sampled_from(sorted(self.twins.holdings))))

    @precondition(lambda self: bool(self.twins.holdings))
    @rule(data=st.data())
    def release_back(self, data: st.DataObject) -> None:
        self.twins.release_to_back(data.draw(st.sampled_from(sorted(self.twins.holdings))))

    @precondition(lambda self: bool(self.twins.holdings))
    @rule(data=st.data(), priority=st.integers(0, 100), duration=st.sampled_from([None, 0.0, 1.0, 5.0]),
          tenant=st.sampled_from([None, *TENANTS]))
    def retain(self, data: st.DataObject, priority: int, duration: float | None, tenant: str | None) -> None:
        name = data.draw(st.sampled_from(sorted(self.twins.holdings)))
        self.twins.retain(name, priority, duration, tenant)

    @precondition(lambda self: bool(self.twins.keyed()))
    @rule(data=st.data(), ttl=st.sampled_from([None, 1.0, 4.0]))
    def pin(self, data: st.DataObject, ttl: float | None) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.twins.keyed()), min_size=1, max_size=3, unique=True))
        self.twins.pin(ids, ttl)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(1, self.twins.num_blocks - 1), max_size=3))
        self.twins.unpin(ids)

    @rule(tenant=st.sampled_from(TENANTS), quota=st.sampled_from([None, 0, 1, 2, 4]))
    def quota(self, tenant: str, quota: int | None) -> None:
        self.twins.quota(tenant, quota)

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 10.0]), settle=st.booleans())
    def advance(self, seconds: float, settle: bool) -> None:
        self.twins.advance(seconds, settle)

    @rule(policy=st.sampled_from(POLICIES))
    def switch(self, policy: Any) -> None:
        self.twins.policy_to(policy)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        self.twins.evict(data.draw(st.lists(st.integers(0, self.twins.num_blocks - 1), max_size=2)))

    @rule(data=st.data())
    def refused(self, data: st.DataObject) -> None:
        # Refused calls (a block freed past its count, an unknown id) change nothing on either side.
        free = [b.block_id for b in self.twins.ref.free_queue]
        over_free, back_again = data.draw(st.booleans()), data.draw(st.booleans())
        if free and over_free:
            ids = [data.draw(st.sampled_from(free))]
            self.twins.both(lambda p: p.free_blocks([p.blocks[i] for i in ids]), lambda p: p.free_blocks(ids))
        else:
            bad = [data.draw(st.sampled_from([-1, self.twins.num_blocks]))]
            self.twins.evict(bad)
        if free and back_again:
            back = [data.draw(st.sampled_from(free))]  # a free block cannot be released again
            self.twins.both(lambda p: p.release_to_back([p.blocks[i] for i in back]),
                            lambda p: p.release_to_back(back))

    @rule()
    def reset(self) -> None:
        self.twins.reset()

    @invariant()
    def agree(self) -> None:
        if self.twins.num_blocks > 1:
            self.twins.check()


TestRetentionLockstep = RetentionLockstep.TestCase
# The profile (quick, ci, pure, thorough) sets the number of examples, as for the other machines.
TestRetentionLockstep.settings = settings(stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


# -- scenarios: each rule once, by hand ----------------------------------------


def _cached(twins: RetentionTwins, name: str, count: int) -> list[int]:
    assert twins.allocate(name, count)
    twins.cache(name)
    return list(twins.holdings[name])


def test_ret_4_lowest_priority_goes_first_then_least_recently_freed() -> None:
    """RET-4: the victim order."""
    twins = RetentionTwins(7)
    a = _cached(twins, "a", 2)
    b = _cached(twins, "b", 2)
    twins.retain("a", 90, None)
    twins.free("a")
    twins.free("b")
    # The two unkeyed blocks, then b's (35) before a's (90), though a was freed first.
    assert twins.allocate("c", 4)
    assert twins.holdings["c"][2:] == list(reversed(b))
    assert a[0] not in twins.holdings["c"] and a[1] not in twins.holdings["c"]


def test_ret_2_a_lower_directive_never_demotes() -> None:
    twins = RetentionTwins(5)
    _cached(twins, "a", 1)
    twins.retain("a", 80, 2.0)
    twins.retain("a", 10, None)
    assert twins.ref.record[twins.holdings["a"][0]] == (80, 2.0)
    twins.retain("a", 80, 5.0)
    assert twins.ref.record[twins.holdings["a"][0]] == (80, 5.0)


def test_ret_3_priority_decays_after_duration_from_the_last_release() -> None:
    """RET-3: decay, restarted by a hit and release."""
    twins = RetentionTwins(5)
    (a,) = _cached(twins, "a", 1)
    twins.retain("a", 90, 2.0)
    twins.free("a")
    twins.advance(1.5)
    twins.hit("again", [a])  # a hit and release restart the duration
    twins.free("again")
    twins.advance(1.5)
    assert twins.ref.record[a] == (90, 2.0)
    twins.advance(0.5)
    assert a not in twins.ref.record  # decayed to the default


def test_ret_5_6_pins_hold_and_a_pin_past_the_budget_is_refused_whole() -> None:
    twins = RetentionTwins(9, pin_budget=0.25)  # 8 usable blocks: 2 may be pinned
    ids = _cached(twins, "a", 3)
    twins.pin(ids[:2], None)
    state = twins.opt.retention_state()
    assert twins.both(lambda p: p.pin([ids[2]], None), lambda p: p.pin([ids[2]], None)) == (
        "error", PinBudgetExceededError)
    assert twins.opt.retention_state()[3] == state[3]  # no pin moved
    assert twins.opt.pins_refused == twins.ref.stats.pins_refused == 1  # the refusal is counted
    twins.free("a")
    assert twins.opt.get_num_free_blocks() == 6  # RET-7: pinned free blocks are not allocatable
    assert twins.allocate("flood", 6)
    assert not set(ids[:2]) & set(twins.holdings["flood"])
    assert set(twins.keyed()) == set(ids[:2])


def test_ret_10_a_hit_refreshes_the_pin_ttl() -> None:
    twins = RetentionTwins(9, pin_budget=0.5)
    (a,) = _cached(twins, "a", 1)
    twins.pin([a], 2.0)
    twins.free("a")
    twins.advance(1.5)
    twins.hit("b", [a])
    twins.free("b")
    twins.advance(1.5)
    assert twins.opt.is_pinned(a) if hasattr(twins.opt, "is_pinned") else a in twins.opt.pins
    twins.advance(1.0)
    assert a not in twins.opt.pins and a not in twins.ref.pins


def test_ret_8_a_tenant_over_quota_loses_its_own_blocks_only() -> None:
    twins = RetentionTwins(12)
    mine = _cached(twins, "mine", 3)
    theirs = _cached(twins, "theirs", 3)
    twins.retain("mine", 35, None, "acme")
    twins.retain("theirs", 35, None, "zeta")
    twins.quota("acme", 1)
    twins.free("theirs")
    twins.free("mine")
    kept = set(twins.free_keyed())
    assert set(theirs) <= kept
    assert len(kept & set(mine)) == 1
    with pytest.raises(InvalidRetentionError):
        twins.ref.retain(theirs[:1], 50, None, "acme")  # free, and another tenant's


def test_ret_11_lru_freq_extends_the_deadline_of_a_key_released_again() -> None:
    """RET-11: a key released twice (level 1) outlives keys released once
    after it, by about 3/4 of the pool's releases; unkeyed blocks go first."""
    twins = RetentionTwins(9, policy="lru-freq")  # 8 usable blocks: the extension is 6 ticks
    (hot,) = _cached(twins, "hot", 1)
    twins.free("hot")  # tick 1, level 0
    twins.hit("again", [hot])
    twins.free("again")  # tick 2, level 1: deadline 2 + 6 = 8
    cold = _cached(twins, "cold", 4)
    twins.free("cold")  # ticks 3..6, level 0 (freed tail first)
    assert twins.opt.freq_deadline(hot) == 8
    assert [twins.opt.freq_deadline(b) for b in cold] == [6, 5, 4, 3]
    assert twins.allocate("new", 3 + 4)  # the 3 unkeyed blocks first, then the cold ones
    assert hot not in twins.holdings["new"] and set(cold) <= set(twins.holdings["new"])
    assert twins.holdings["new"][3:] == list(reversed(cold))  # least recently freed first, as in lru
    twins.free("new")
    assert twins.allocate("more", 2)
    assert hot not in twins.holdings["more"]  # the unkeyed blocks before any keyed one


def test_ret_11_an_extended_deadline_still_passes() -> None:
    """RET-11: the extension delays a hot key, it does not keep it forever:
    once every key released once is newer than its deadline, it goes."""
    twins = RetentionTwins(9, policy="lru-freq")
    (hot,) = _cached(twins, "hot", 1)
    twins.free("hot")
    twins.hit("again", [hot])
    twins.free("again")  # deadline 2 + 6 = 8
    key = twins.ref.blocks[hot].block_hash
    evicted_at = None
    for turn in range(20):
        _cached(twins, f"one{turn}", 1)
        twins.free(f"one{turn}")
        if evicted_at is None and twins.ref.blocks[hot].block_hash != key:
            evicted_at = turn
    # Turn t allocates, then releases tick 3 + t; at turn t's allocation the 7 other blocks hold
    # ticks t - 4 .. t + 2. At turn 12 the oldest is 8, hot's deadline: a tie, and hot, earlier
    # in the queue, goes first (not before: an older tick was still there).
    assert evicted_at == 12


def test_ret_11_the_release_memory_outlives_an_eviction() -> None:
    """RET-11: a key evicted and computed again keeps its release count
    (the memory holds the last 2 x (N - 1) keys released, resident or not)."""
    twins = RetentionTwins(5, policy="lru-freq")
    assert twins.allocate("a", 1)
    hashes = twins.cache("a")
    (a,) = twins.holdings["a"]
    key = twins.ref.blocks[a].block_hash
    twins.free("a")
    twins.evict([a])
    assert twins.allocate("b", 1)
    twins.cache("b", hashes)  # the same prefix, computed again
    twins.free("b")
    assert twins.ref.release_memory[key] == 2
    (b,) = twins.keyed()
    assert twins.opt.freq_deadline(b) == 2 + 3  # tick 2, level 1, extension 3 (4 usable blocks)


@given(tokens=st.lists(st.integers(0, 50), min_size=4, max_size=24),
       salts=st.lists(st.text(min_size=1, max_size=4), min_size=2, max_size=2, unique=True))
@settings(deadline=None)
def test_ret_9_cross_tenant_hits_are_impossible(tokens: list[int], salts: list[str]) -> None:
    """RET-9: requests with different salts share no block hash, whatever their tokens."""
    from pagedkv.reference.hasher import make_block_hasher
    from pagedkv.spec.request import Request
    hasher = make_block_hasher("sha256", 4)
    a = Request("a", tokens, block_hasher=hasher, cache_salt=salts[0])
    b = Request("b", tokens, block_hasher=hasher, cache_salt=salts[1])
    assert not set(a.block_hashes) & set(b.block_hashes)


# -- RET-1: lru is today's order ---------------------------------------------------


@pytest.mark.parametrize("kernel,pool", [(ReferenceKernel, ReferencePool), (OptimizedKernel, OptimizedPool)])
def test_ret_1_lru_gives_the_same_blocks_and_events_as_the_plain_pool(kernel: Any, pool: Any) -> None:
    import random
    rng = random.Random(7)
    plain = kernel(16, True, enable_kv_cache_events=True)
    retained = pool(16, True, policy="lru", enable_kv_cache_events=True)
    held: list[list[int]] = []
    freed: list[list[int]] = []
    counter = 0

    def ids(blocks: list[Any]) -> list[int]:
        return [getattr(b, "block_id", b) for b in blocks]

    def as_blocks(p: Any, block_ids: list[int]) -> list[Any]:
        return [p.blocks[i] for i in block_ids] if hasattr(p, "blocks") and isinstance(p.blocks, list) else block_ids

    for _ in range(400):
        action = rng.random()
        if action < 0.4 and plain.get_num_free_blocks():
            count = rng.randint(1, min(4, plain.get_num_free_blocks()))
            got = [ids(p.get_new_blocks(count)) for p in (plain, retained)]
            assert got[0] == got[1]
            hashes = [f"k{counter + i}".encode() for i in range(count)]
            counter += count
            if rng.random() < 0.7:
                for p in (plain, retained):
                    p.cache_full_blocks(FakeRequest(list(range(count * BLOCK_SIZE))), as_blocks(p, got[0]),
                                        block_hashes=hashes, num_cached_blocks=0, num_full_blocks=count,
                                        block_size=BLOCK_SIZE, group_id=0)
            held.append(got[0])
        elif action < 0.7 and held:
            blocks = held.pop(rng.randrange(len(held)))
            for p in (plain, retained):
                p.free_blocks(as_blocks(p, list(reversed(blocks))))
            freed.append(blocks)
        elif action < 0.75:
            victim = rng.randrange(16)
            for p in (plain, retained):
                p.evict_blocks([victim])
        elif held or freed:
            # A hit on blocks held or freed (a freed one may be cached still, or reused).
            pool_of = held + freed
            blocks = pool_of[rng.randrange(len(pool_of))]
            for p in (plain, retained):
                p.touch(as_blocks(p, blocks))
            held.append(list(blocks))
        assert plain.snapshot() == retained.snapshot()
        assert plain.get_num_free_blocks() == retained.get_num_free_blocks()


# -- planted bugs: the lockstep and the checkers catch each --------------------------


@contextmanager
def planted(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name`` replaced for the block; a method its base defines is
    shadowed on ``owner`` and the shadow removed after."""
    own = name in owner.__dict__
    original = owner.__dict__.get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _demoting_retain(self: Any, block_ids: Any, priority: int, duration: Any = None, tenant: Any = None) -> None:
    for block in block_ids:  # the bug: a later, lower directive overrides (TensorRT-LLM's behaviour)
        self._prio[block], self._dur[block] = priority, duration


def test_gate_max_rule() -> None:
    with planted(OptimizedPool, "retain", _demoting_retain), pytest.raises(AssertionError):
        test_ret_2_a_lower_directive_never_demotes()


def test_gate_pinned_block_evicted() -> None:
    def ranks_pinned(self: Any, released: Any) -> None:
        for block in released:  # the bug: a released pinned block is ranked for eviction
            self._stamp[block] += 1
            self._released_at[block] = self.now
            self._enter(block)
        self.settle()
    with planted(OptimizedPool, "_released", ranks_pinned), pytest.raises(AssertionError, match="RET-5"):
        test_ret_5_6_pins_hold_and_a_pin_past_the_budget_is_refused_whole()


def test_gate_budget() -> None:
    def loose(self: Any) -> int:
        return int(self.pin_budget * (self.num_blocks - 1)) + 1  # the bug: one block past the budget
    with planted(OptimizedPool, "pin_capacity", loose), pytest.raises(AssertionError, match="RET-6|!="):
        test_ret_5_6_pins_hold_and_a_pin_past_the_budget_is_refused_whole()


def test_gate_decay() -> None:
    def no_timer(self: Any, released: Any) -> None:
        for block in released:  # the bug: no decay timer, priorities never end
            self._stamp[block] += 1
            self._released_at[block] = self.now
            if block not in self.pins:
                self._enter(block)
        self.settle()
    with planted(OptimizedPool, "_released", no_timer), pytest.raises(AssertionError):
        test_ret_3_priority_decays_after_duration_from_the_last_release()


def test_gate_quota_takes_only_the_tenants_blocks() -> None:
    def global_victim(self: Any, tenant: str) -> int:
        bitmap = self._bitmap  # the bug: the pool-wide victim, whichever tenant's it is
        level = (bitmap & -bitmap).bit_length() - 1
        return int(min((s, b) for s, b in self._levels[level] if self._level[b] == level and self._seq[b] == s)[1])
    with planted(OptimizedPool, "_tenant_victim", global_victim), pytest.raises(AssertionError):
        test_ret_8_a_tenant_over_quota_loses_its_own_blocks_only()


def test_gate_reference_checker_names_a_broken_budget() -> None:
    twins = RetentionTwins(9, pin_budget=0.25)
    ids = _cached(twins, "a", 3)
    twins.ref.pins.update({block: (None, None) for block in ids})  # plant: past the budget
    with pytest.raises(AssertionError, match="RET-6"):
        twins.check()


def _forced_active_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _ORIGINAL_INIT(self, *args, **kwargs)
    self._activate()  # rank the queue even under lru (the heaps, not the kernel's front)


_ORIGINAL_INIT = OptimizedPool.__init__


def test_ret_1_holds_with_the_ranked_structure_too() -> None:
    """RET-1 again with the optimized pool ranking under lru: its heaps give the kernel's order."""
    with planted(OptimizedPool, "__init__", _forced_active_init):
        test_ret_1_lru_gives_the_same_blocks_and_events_as_the_plain_pool(OptimizedKernel, OptimizedPool)


def test_gate_lru_order_unkeyed_first() -> None:
    """RET-1's gate: ranking unkeyed free blocks below the default breaks vLLM's order (D-RET-2)."""
    def unkeyed_first(self: Any, block: int) -> int:
        return 0 if self._gid[block] < 0 else 35
    with planted(OptimizedPool, "__init__", _forced_active_init), planted(OptimizedPool, "_rank_of", unkeyed_first), \
            pytest.raises(AssertionError):
        test_ret_1_lru_gives_the_same_blocks_and_events_as_the_plain_pool(OptimizedKernel, OptimizedPool)


def test_gate_lru_freq_levels() -> None:
    """RET-11's gate: a pool that forgets the release count (every key at level 0) is plain lru."""
    def no_levels(self: Any, released: Any) -> None:
        for block in released:  # the bug: each release is a key's first
            if self._gid[block] >= 0:
                self.tick += 1
                self._tick[block], self._flevel[block] = self.tick, 0
    with planted(OptimizedPool, "_count_releases", no_levels), pytest.raises(AssertionError):
        test_ret_11_lru_freq_extends_the_deadline_of_a_key_released_again()


def test_gate_lru_freq_heads() -> None:
    """RET-11's gate: taking the lowest level's head (the priority rule) instead of the least deadline."""
    def lowest_level(self: Any) -> int:
        bitmap = self._bitmap  # the bug: the least level wins, whatever the deadlines
        level = (bitmap & -bitmap).bit_length() - 1
        _, block = self._head(level)
        self._leave(block)
        return int(block)
    with planted(OptimizedPool, "_pop_victim", lowest_level), pytest.raises(AssertionError):
        test_ret_11_an_extended_deadline_still_passes()


def test_gate_reference_forgets_evicted_keys() -> None:
    """RET-11's gate on the reference: a memory that drops a key with its block (no ghost) loses
    the count of a prefix computed again, and the twins disagree."""
    def forgetful(self: Any, block: Any) -> None:
        self.tick += 1  # the bug: the count lives with the block, not with the key
        self.freq[block.block_id] = (self.tick, 0)
    with planted(ReferencePool, "_count_release", forgetful), pytest.raises(AssertionError):
        test_ret_11_the_release_memory_outlives_an_eviction()
