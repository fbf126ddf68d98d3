"""Retention at the manager, in lockstep (spec/retention.md, "Manager
operations": RET-1, RETM-1, RETM-2, RETM-3; the pool rules RET-2..RET-10 through it).

Both ``KVCacheManager`` s built with the same ``RetentionConfig`` on one
injected clock are driven alike by a Hypothesis state machine: requests on
shared prefixes admitted with their hits, decode steps, frees, directives
mapped onto a request's blocks, prefix pins and unpins, quotas, clock
advances, policy switches, explicit evictions and resets. After every call
both sides give the same result or error type (a refused call leaving both
unchanged), and after every step the same snapshot, events, retention state
and counters, with both pools' ``check_retention`` and the kernels'
invariants. Planted-bug gates show the machine catches a manager that keeps
a fast path on, maps a directive onto the wrong block, or pins a partial prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pagedkv.optimized as optimized
import pagedkv.reference as reference
from pagedkv.optimized import manager as optimized_manager
from pagedkv.optimized import retention_manager as optimized_retention
from pagedkv.optimized.pool.retention import check_retention as check_optimized
from pagedkv.reference.features.retention import check_retention as check_reference
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, PagedKVError
from pagedkv.spec.errors import InvalidRetentionError, PinBudgetExceededError
from pagedkv.spec.retention import RetentionDirective
from pagedkv.spec.retention_config import RetentionConfig

BLOCK_SIZE = 2
MAX_MODEL_LEN = 24
TENANTS = ("acme", "zeta")
PREFIXES = ((5, 6, 7, 8), (9, 9, 9, 9, 9, 9), (5, 6))


STATS = 6
"""Where the pools' ``retention_state()`` puts its counters (pins granted, refused, quota evictions)."""


def without_stats(state: tuple[object, ...]) -> tuple[object, ...]:
    """A pool's retention state less its counters: a refused pin counts itself and changes nothing else."""
    return state[:STATS] + state[STATS + 1:]


@dataclass
class Clock:
    """The injected clock both managers' pools read."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def make_manager(impl: ModuleType, num_blocks: int, retention: RetentionConfig | None, **kwargs: Any) -> Any:
    config = KVCacheConfig(num_blocks, (), (KVCacheGroupSpec(("l0",), FullAttentionSpec(BLOCK_SIZE, 1, 8, "float16")),))
    return impl.KVCacheManager(config, MAX_MODEL_LEN, enable_kv_cache_events=True, retention=retention, **kwargs)


def normalize(result: Any) -> Any:
    if hasattr(result, "get_block_ids"):
        return ("blocks", result.get_block_ids())
    if isinstance(result, tuple):
        return tuple(normalize(item) for item in result)
    return result


def kernel_invariants(manager: Any) -> None:
    """The kernel's invariants, its free count read as the kernel's (the
    queue's length): the retention pool leaves pinned free blocks out of its
    own (RET-7), which ``check_retention`` checks instead."""
    pool = manager.block_pool
    own = pool.get_num_free_blocks
    pool.get_num_free_blocks = lambda: len(pool.snapshot().free_queue)
    try:
        manager.check_invariants()
    finally:
        pool.get_num_free_blocks = own


@dataclass
class ManagerTwins:
    """A reference and an optimized manager with retention, and the requests
    the driver holds (name -> each side's request)."""

    num_blocks: int
    policy: Any = "priority"
    pin_budget: float = 0.25
    quotas: dict[str, int] = field(default_factory=dict)
    clock: Clock = field(default_factory=Clock)
    requests: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        config = RetentionConfig(self.policy, self.pin_budget, self.quotas, self.clock)
        self.sides = [make_manager(reference, self.num_blocks, config),
                      make_manager(optimized, self.num_blocks, config)]

    def both(self, call: Any) -> Any:
        """``call(index, manager)`` on both: the same result or error type; a
        refused call changes neither side (the refused-pins counter aside)."""
        before = [(m.snapshot(), without_stats(m.retention_state())) for m in self.sides]
        outcomes: list[tuple[str, Any]] = []
        for index, manager in enumerate(self.sides):
            try:
                outcomes.append(("ok", normalize(call(index, manager))))
            except PagedKVError as error:
                outcomes.append(("error", type(error).__name__))
        assert outcomes[0] == outcomes[1], f"reference {outcomes[0]} != optimized {outcomes[1]}"
        if outcomes[0][0] == "error":
            for manager, state in zip(self.sides, before):
                assert (manager.snapshot(), without_stats(manager.retention_state())) == state, \
                    "a refused call changed state"
        self.check()
        return outcomes[0]

    def check(self) -> None:
        ref, opt = self.sides
        assert ref.snapshot() == opt.snapshot()
        assert ref.take_events() == opt.take_events()
        assert ref.retention_state() == opt.retention_state()
        assert ref.retention_counters() == opt.retention_counters()
        assert ref.block_pool.get_num_free_blocks() == opt.block_pool.get_num_free_blocks()
        check_reference(ref.block_pool)
        check_optimized(opt.block_pool)
        for manager in self.sides:
            kernel_invariants(manager)

    def admit(self, name: str, tokens: list[int], tenant_salt: str | None = None) -> bool:
        extra = {} if tenant_salt is None else {"cache_salt": tenant_salt}
        pair = [m.make_request(name, tokens, **extra) for m in self.sides]

        def call(index: int, manager: Any) -> Any:
            hit, num_hit = manager.get_computed_blocks(pair[index])
            return manager.allocate_slots(pair[index], len(tokens) - num_hit, num_hit, hit if num_hit else None)

        kind, result = self.both(call)
        if kind == "ok" and result is not None:
            for request in pair:
                request.num_computed_tokens = len(tokens)
            self.requests[name] = pair
            return True
        return False

    def decode(self, name: str, token: int) -> None:
        pair = self.requests[name]
        if pair[0].num_tokens >= MAX_MODEL_LEN:
            return
        for request in pair:
            request.append_output_token_ids([token])
        kind, result = self.both(lambda i, m: m.allocate_slots(pair[i], 1))
        if kind == "ok" and result is not None:
            for request in pair:
                request.num_computed_tokens += 1

    def free(self, name: str) -> None:
        pair = self.requests.pop(name)
        self.both(lambda i, m: m.free(pair[i]))


class RetentionManagerLockstep(RuleBasedStateMachine):
    """Both managers with retention under every retention operation."""

    def __init__(self) -> None:
        super().__init__()
        self.twins = ManagerTwins(8)
        self.counter = 0

    @initialize(num_blocks=st.integers(5, 16), policy=st.sampled_from(["lru", "priority"]),
                budget=st.sampled_from([0.0, 0.25, 0.5]),
                quotas=st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 3), max_size=1))
    def build(self, num_blocks: int, policy: Any, budget: float, quotas: dict[str, int]) -> None:
        self.twins = ManagerTwins(num_blocks, policy=policy, pin_budget=budget, quotas=quotas)

    def names(self) -> list[str]:
        return sorted(self.twins.requests)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 4), max_size=6),
          salt=st.sampled_from([None, *TENANTS]))
    def admit(self, prefix: tuple[int, ...], tail: list[int], salt: str | None) -> None:
        self.counter += 1
        self.twins.admit(f"r{self.counter}", [*prefix, *tail], salt)

    @precondition(lambda self: bool(self.names()))
    @rule(data=st.data(), token=st.integers(1, 4))
    def decode(self, data: st.DataObject, token: int) -> None:
        self.twins.decode(data.draw(st.sampled_from(self.names())), token)

    @precondition(lambda self: bool(self.names()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.twins.free(data.draw(st.sampled_from(self.names())))

    @precondition(lambda self: bool(self.names()))
    @rule(data=st.data(), start=st.integers(0, 6), length=st.sampled_from([None, 1, 2, 5]),
          priority=st.integers(0, 100), duration=st.sampled_from([None, 0.0, 1.0, 5.0]),
          generated=st.sampled_from([None, 10, 90]), tenant=st.sampled_from([None, *TENANTS]))
    def apply(self, data: st.DataObject, start: int, length: int | None, priority: int, duration: float | None,
              generated: int | None, tenant: str | None) -> None:
        name = data.draw(st.sampled_from(self.names()))
        ranges = [RetentionDirective(start, None if length is None else start + length, priority, duration)]
        after = None if generated is None else RetentionDirective(0, None, generated, 2.0)
        prompt = self.twins.requests[name][0].num_prompt_tokens
        self.twins.both(lambda i, m: m.apply_retention(name, ranges, generated=after, tenant=tenant,
                                                       num_prompt_tokens=prompt))

    @precondition(lambda self: bool(self.names()))
    @rule(data=st.data(), num_tokens=st.sampled_from([None, 1, 2, 4, 7]), ttl=st.sampled_from([None, 1.0, 4.0]))
    def pin(self, data: st.DataObject, num_tokens: int | None, ttl: float | None) -> None:
        name = data.draw(st.sampled_from(self.names()))
        self.twins.both(lambda i, m: m.pin_prefix(name, num_tokens, ttl))

    @precondition(lambda self: bool(self.names()))
    @rule(data=st.data(), num_tokens=st.sampled_from([None, 2]))
    def unpin(self, data: st.DataObject, num_tokens: int | None) -> None:
        name = data.draw(st.sampled_from(self.names()))
        self.twins.both(lambda i, m: m.unpin_prefix(name, num_tokens))

    @rule(ids=st.lists(st.integers(1, 15), max_size=2))
    def unpin_blocks(self, ids: list[int]) -> None:
        self.twins.both(lambda i, m: m.unpin_blocks([b for b in ids if b < self.twins.num_blocks]))

    @rule(tenant=st.sampled_from(TENANTS), quota=st.sampled_from([None, 0, 1, 3]))
    def quota(self, tenant: str, quota: int | None) -> None:
        self.twins.both(lambda i, m: m.set_tenant_quota(tenant, quota))

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 10.0]))
    def advance(self, seconds: float) -> None:
        self.twins.clock.now += seconds

    @rule(policy=st.sampled_from(["lru", "priority"]))
    def switch(self, policy: Any) -> None:
        self.twins.both(lambda i, m: m.set_retention_policy(policy))

    @rule(ids=st.lists(st.integers(0, 15), max_size=2))
    def evict(self, ids: list[int]) -> None:
        self.twins.both(lambda i, m: m.evict_blocks([b for b in ids if b < self.twins.num_blocks]))

    @rule()
    def reset(self) -> None:
        self.twins.both(lambda i, m: m.reset_prefix_cache())

    @rule(bad=st.sampled_from(["unknown", "overlap", "tenant", "num_tokens", "ttl"]))
    def refused(self, bad: str) -> None:
        name = self.names()[0] if self.names() else "nobody"
        calls = {
            "unknown": lambda i, m: m.pin_prefix("nobody"),
            "overlap": lambda i, m: m.apply_retention(
                name, [RetentionDirective(0, 4, 50), RetentionDirective(2, 6, 60)], num_prompt_tokens=4),
            "tenant": lambda i, m: m.apply_retention(name, tenant="", num_prompt_tokens=4),
            "num_tokens": lambda i, m: m.pin_prefix(name, 0),
            "ttl": lambda i, m: m.pin_prefix(name, None, -1.0),
        }
        kind, _ = self.twins.both(calls[bad])
        assert kind == "error"

    @invariant()
    def agree(self) -> None:
        self.twins.check()


TestRetentionManagerLockstep = RetentionManagerLockstep.TestCase
# The profile (quick, ci, pure, thorough) sets the number of examples, as for the other machines.
TestRetentionManagerLockstep.settings = settings(stateful_step_count=30, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])


# -- scenarios ---------------------------------------------------------------------


@pytest.mark.parametrize("impl", [reference, optimized], ids=["reference", "optimized"])
def test_retm_1_a_range_maps_onto_the_blocks_holding_its_first_tokens(impl: ModuleType) -> None:
    clock = Clock()
    manager = make_manager(impl, 12, RetentionConfig("priority", 0.5, clock=clock))
    request = manager.make_request("a", list(range(10, 20)))  # 5 blocks of 2 tokens
    assert manager.allocate_slots(request, 10) is not None
    # Tokens [2, 5): blocks 1 and 2 start inside (tokens 2, 4); block 3 starts at 6, outside.
    manager.apply_retention("a", [RetentionDirective(2, 5, 80, 3.0)], generated=RetentionDirective(0, None, 20),
                            num_prompt_tokens=8)
    ids = manager.get_block_ids("a")[0]
    records = dict(manager.retention_state()[1])
    assert records[ids[1]] == (80, 3.0) and records[ids[2]] == (80, 3.0)
    assert records[ids[0]] == (35, None) and records[ids[3]] == (35, None)
    assert records[ids[4]] == (20, None)  # starts at token 8, the prompt's end: the generated directive


@pytest.mark.parametrize("impl", [reference, optimized], ids=["reference", "optimized"])
def test_retm_2_a_pinned_prefix_survives_a_flood_lru_does_not(impl: ModuleType) -> None:
    def flood(manager: Any) -> int:
        system = [7] * 8
        first = manager.make_request("sys", system + [1, 2])
        assert manager.allocate_slots(first, 10) is not None
        if manager.retention_pool is not None and manager.retention_pool.pin_budget:
            assert len(manager.pin_prefix("sys", 8)) == 4
        manager.free(first)
        for index in range(6):  # unique prompts that take every free block
            other = manager.make_request(f"u{index}", [100 + index] * 14)
            assert manager.allocate_slots(other, 14) is not None
            manager.free(other)
        again = manager.make_request("again", system + [3])
        return int(manager.get_computed_blocks(again)[1])

    assert flood(make_manager(impl, 13, None)) == 0
    assert flood(make_manager(impl, 13, RetentionConfig("lru", 0.0))) == 0
    assert flood(make_manager(impl, 13, RetentionConfig("lru", 0.4))) == 8


@pytest.mark.parametrize("impl", [reference, optimized], ids=["reference", "optimized"])
def test_ret_6_a_refused_prefix_pin_changes_nothing_but_the_counter(impl: ModuleType) -> None:
    manager = make_manager(impl, 9, RetentionConfig("lru", 0.25))  # 2 blocks may be pinned
    request = manager.make_request("a", list(range(10, 18)))
    assert manager.allocate_slots(request, 8) is not None
    before = manager.snapshot()
    with pytest.raises(PinBudgetExceededError):
        manager.pin_prefix("a")
    assert manager.snapshot() == before and manager.retention_state()[3] == []
    assert manager.retention_counters() == {"pins_granted": 0, "pins_refused": 1, "quota_evictions": 0}
    assert manager.pin_prefix("a", 4) == manager.get_block_ids("a")[0][:2]


@pytest.mark.parametrize("impl", [reference, optimized], ids=["reference", "optimized"])
def test_retention_calls_need_a_configured_manager(impl: ModuleType) -> None:
    manager = make_manager(impl, 9, None)
    assert manager.retention_pool is None
    with pytest.raises(InvalidRetentionError, match="not configured"):
        manager.pin_blocks([1])
    with pytest.raises(InvalidRetentionError, match="retention must be"):
        make_manager(impl, 9, {"policy": "lru"})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [dict(policy="fifo"), dict(pin_budget=2), dict(tenant_quotas={"a": -1}),
                                 dict(tenant_quotas={"": 1}), dict(clock=3)])
def test_retention_config_names_the_bad_field(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidRetentionError, match="retention."):
        RetentionConfig(**bad)


# -- RET-1 at the manager: lru and no directives is the plain manager ----------------------


@settings(deadline=None, max_examples=25)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "decode", "free"]), st.integers(0, 5),
                              st.lists(st.integers(1, 3), min_size=1, max_size=14)), max_size=25))
@pytest.mark.parametrize("impl", [reference, optimized], ids=["reference", "optimized"])
def test_ret_1_lru_without_directives_is_the_plain_manager(impl: ModuleType, ops: list[Any]) -> None:
    plain = make_manager(impl, 12, None)
    retained = make_manager(impl, 12, RetentionConfig("lru", 0.25))
    held: dict[str, list[Any]] = {}
    for index, (op, pick, tokens) in enumerate(ops):
        names = sorted(held)
        if op == "admit":
            pair = [m.make_request(f"r{index}", tokens) for m in (plain, retained)]
            results = []
            for manager, request in zip((plain, retained), pair):
                hit, num_hit = manager.get_computed_blocks(request)
                results.append(normalize(manager.allocate_slots(request, len(tokens) - num_hit, num_hit,
                                                                hit if num_hit else None)))
            assert results[0] == results[1]
            if results[0] is not None:
                for request in pair:
                    request.num_computed_tokens = len(tokens)
                held[f"r{index}"] = pair
        elif names and op == "decode":
            pair = held[names[pick % len(names)]]
            if pair[0].num_tokens < MAX_MODEL_LEN:
                for request in pair:
                    request.append_output_token_ids([1])
                results = [normalize(m.allocate_slots(r, 1)) for m, r in zip((plain, retained), pair)]
                assert results[0] == results[1]
                if results[0] is not None:
                    for request in pair:
                        request.num_computed_tokens += 1
        elif names:
            pair = held.pop(names[pick % len(names)])
            for manager, request in zip((plain, retained), pair):
                manager.free(request)
        assert plain.snapshot() == retained.snapshot()
        assert plain.take_events() == retained.take_events()
        assert plain.block_pool.get_num_free_blocks() == retained.block_pool.get_num_free_blocks()


# -- planted bugs ------------------------------------------------------------------------------


@contextmanager
def planted(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _run_machine() -> None:
    run_state_machine_as_test(RetentionManagerLockstep, settings=settings(  # type: ignore[no-untyped-call]
        max_examples=60, stateful_step_count=30, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck)))


def _fast_paths_kept(coordinator: Any) -> Any:
    return coordinator.native_release() or coordinator.release


def test_gate_fast_paths_left_on() -> None:
    """A manager that keeps its fast paths with retention on: the admission
    step and the C release move blocks past the retention pool (RETM-3, D-RET-10)."""
    with planted(optimized_manager, "route_to_general_paths", _fast_paths_kept), \
            pytest.raises(AssertionError):
        _run_machine()
    with planted(optimized_manager, "route_to_general_paths", _fast_paths_kept), \
            pytest.raises((AssertionError, PagedKVError)):
        test_retm_2_a_pinned_prefix_survives_a_flood_lru_does_not(optimized)


def test_gate_directive_on_the_wrong_block() -> None:
    """Mapping a range by its last token instead of its first (RETM-1)."""
    def off_by_one(self: Any, request_id: str, ranges: Any = (), *, generated: Any = None, tenant: Any = None,
                   num_prompt_tokens: int) -> None:
        shifted = [RetentionDirective(r.start + 1, None if r.end is None else r.end + 1, r.priority, r.duration)
                   for r in ranges]
        original(self, request_id, shifted, generated=generated, tenant=tenant, num_prompt_tokens=num_prompt_tokens)

    original = optimized_retention.RetentionOperations.apply_retention
    with planted(optimized_retention.RetentionOperations, "apply_retention", off_by_one), \
            pytest.raises(AssertionError):
        _run_machine()


def test_gate_partial_pin() -> None:
    """A prefix pin that pins what fits instead of refusing whole (RET-6 via RETM-2)."""
    def partial_pin(self: Any, request_id: str, num_tokens: Any = None, ttl: Any = None) -> list[int]:
        pool = self._retention()
        ids = self._prefix(request_id, num_tokens)[: max(0, pool.pin_capacity() - len(pool.pins))]
        if ids:
            pool.pin(ids, ttl)
        return list(ids)

    with planted(optimized_retention.RetentionOperations, "pin_prefix", partial_pin), \
            pytest.raises((AssertionError, pytest.fail.Exception)):
        test_ret_6_a_refused_prefix_pin_changes_nothing_but_the_counter(optimized)
