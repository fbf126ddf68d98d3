"""The retention study's cache simulator (bench.retention_study) on hand-made traces:
known hit counts for vLLM's LRU order and for Belady's MIN, MIN never below any
online policy and equal to an exhaustive search's optimum, and the keyed LRU equal
to the free-queue LRU."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from bench.retention_study import (
    BLOCK_TOKENS,
    POLICIES,
    UNANNOTATED,
    Request,
    Workload,
    simulate,
    system_prompt_workload,
)
from pagedkv.simulate.retention_policies import ChainShape, KeyedPolicy, key_lru


def _workload(*chains: tuple[int, ...], prefix: tuple[int, ...] = ()) -> Workload:
    # One token past the last full block: every full block may hit.
    requests = tuple(Request(len(c) * BLOCK_TOKENS + 1, c) for c in chains)
    return Workload("hand", requests, prefix, len({b for c in chains for b in c}))


def _hits(workload: Workload, policy: str, capacity: int) -> int:
    shape = ChainShape([r.blocks for r in workload.requests])
    return simulate(workload, POLICIES[policy](capacity, shape, workload)).hit_blocks


def test_lru_evicts_a_chains_tail_first() -> None:
    # vLLM frees [1, 2, 3] as 3, 2, 1: the request [4] evicts 3, so [1, 2, 3] hits 1 and 2.
    assert _hits(_workload((1, 2, 3), (4,), (1, 2, 3)), "lru", 3) == 2


def test_min_keeps_what_is_used_next_where_lru_does_not() -> None:
    # Capacity 4: [5, 6] must evict two blocks. LRU takes 2 and 1 (least recently
    # freed), so the second [1, 2] misses; MIN takes 4 and 3 (never used again).
    workload = _workload((1, 2), (3, 4), (5, 6), (1, 2))
    assert _hits(workload, "lru", 4) == 0
    assert _hits(workload, "min", 4) == 2


def test_a_hit_never_covers_the_last_token() -> None:
    # 1024 tokens = two full blocks, but the last token is computed: at most one block hits.
    workload = Workload("hand", (Request(1024, (1, 2)), Request(1024, (1, 2))), (), 2)
    shape = ChainShape([r.blocks for r in workload.requests])
    assert simulate(workload, POLICIES["lru"](4, shape, workload)).hit_blocks == 1


def _random_chains(seed: int, requests: int = 60) -> list[tuple[int, ...]]:
    """Chains that share prefixes: each request extends a prefix of an earlier one."""
    rng = random.Random(seed)
    chains: list[tuple[int, ...]] = []
    top = 0
    for _ in range(requests):
        base = rng.choice(chains)[:rng.randint(0, 6)] if chains and rng.random() < 0.7 else ()
        extra = rng.randint(1, 5)
        chains.append(base + tuple(range(top, top + extra)))
        top += extra
    return chains


@pytest.mark.parametrize("seed", range(6))
def test_min_is_never_below_an_online_policy(seed: int) -> None:
    workload = _workload(*_random_chains(seed))
    for capacity in (12, 25, 50):
        best = _hits(workload, "min", capacity)
        for policy in UNANNOTATED:
            assert _hits(workload, policy, capacity) <= best, (seed, capacity, policy)


@pytest.mark.parametrize("seed", range(3))
def test_keyed_lru_is_the_free_queue_lru(seed: int) -> None:
    workload = _workload(*_random_chains(seed))
    shape = ChainShape([r.blocks for r in workload.requests])
    for capacity in (12, 30):
        keyed = KeyedPolicy(capacity, shape, "keyed-lru", key_lru, leaf_only=False)
        queue = POLICIES["lru"](capacity, shape, workload)
        assert simulate(workload, keyed).hit_blocks == simulate(workload, queue).hit_blocks


def test_a_pinned_prefix_survives_a_flood() -> None:
    base = _workload(*[(i,) for i in range(40)])
    workload = system_prompt_workload(base, prefix_blocks=2, burst_every=5, burst_share=1.0,
                                      doc_blocks=4)
    shape = ChainShape([r.blocks for r in workload.requests])
    capacity = workload.working_set // 2
    pinned = simulate(workload, POLICIES["lru+pin"](capacity, shape, workload))
    lru = simulate(workload, POLICIES["lru"](capacity, shape, workload))
    assert pinned.prefix_hits == pinned.prefixed == 39
    assert lru.prefix_hits < lru.prefixed


def _optimal_hits(chains: tuple[tuple[int, ...], ...], capacity: int) -> int:
    """The most hits any eviction choice gets: every request's admissions may evict
    any set of unpinned blocks of the forced size (exhaustive, tiny traces only)."""
    memo: dict[tuple[int, frozenset[int]], int] = {}

    def best(index: int, resident: frozenset[int]) -> int:
        if index == len(chains):
            return 0
        if (index, resident) not in memo:
            chain = chains[index]
            hit = 0
            while hit < len(chain) and chain[hit] in resident:
                hit += 1
            after = resident | frozenset(chain)
            evictable = sorted(resident - frozenset(chain))
            overflow = max(len(after) - capacity, 0)
            memo[index, resident] = hit + max(best(index + 1, after - frozenset(victims))
                                              for victims in combinations(evictable, overflow))
        return memo[index, resident]

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_min_is_the_optimum_of_the_model(seed: int) -> None:
    rng = random.Random(seed)
    chains: list[tuple[int, ...]] = []
    for top in range(0, 18, 2):
        base = rng.choice(chains)[:rng.randint(0, 3)] if chains and rng.random() < 0.7 else ()
        chains.append(base + tuple(range(top, top + rng.randint(1, 2))))
    workload = _workload(*chains)
    for capacity in (4, 5):
        if max(map(len, chains)) <= capacity:
            assert _hits(workload, "min", capacity) == _optimal_hits(tuple(chains), capacity)
