"""``pagedkv simulate``'s replays through real managers: the unbounded cache
reaches the ideal, the engine loop serves every request (with preemptions
when the pool is small), and the prefix-aware router, which sees only the
replicas' KV events, knows exactly what each replica caches."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.simulate.analysis import analyze
from pagedkv.simulate.capacity import Capacity, parse_capacities, single_group_config
from pagedkv.simulate.fleet import PrefixAwareRouter, run_fleet
from pagedkv.simulate.replica import Replica, SchedulerConfig
from pagedkv.simulate.requests import PrefixHasher, SimRequest, TokenSource
from pagedkv.simulate.workload import Workload, chat_workload, load_workload
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.types import BlockHashWithGroupId, get_block_hash

DATA = Path(__file__).parent / "data"
TRACES = {
    "conversation": str(DATA / "mooncake_conversation_excerpt.jsonl"),
    "synthetic": str(DATA / "mooncake_synthetic_excerpt.jsonl"),
}


def _hit_rate(workload: Workload, num_blocks: int, block_size: int, mode: str = "cache",
              **options: object) -> tuple[float, int]:
    result = run_fleet(workload, single_group_config(num_blocks, block_size), mode=mode, **options)  # type: ignore[arg-type]
    hits = sum(s.hit_tokens for s in result.replicas)
    return hits / workload.prompt_tokens, sum(s.evicted_blocks for s in result.replicas)


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("block_size", [512, 16])
def test_unbounded_cache_reaches_the_ideal(name: str, block_size: int) -> None:
    workload = load_workload(TRACES[name])
    if block_size == 16:
        workload = workload.limited(80)
    analysis = analyze(workload, block_size, output_blocks=False, reuse=False)
    inf = parse_capacities("inf", analysis, block_size)[0]
    rate, evicted = _hit_rate(workload, inf.num_blocks, block_size)
    assert evicted == 0
    assert rate == analysis.ideal_hit_rate > 0.3


def test_hit_rate_grows_with_capacity_and_stays_below_the_ideal() -> None:
    workload = load_workload(TRACES["synthetic"])
    analysis = analyze(workload, 512, output_blocks=False, reuse=False)
    rates = []
    for capacity in parse_capacities("0.05x,0.25x,1x", analysis, 512):
        rate, evicted = _hit_rate(workload, max(capacity.num_blocks, analysis.max_request_blocks + 1), 512)
        assert rate <= analysis.ideal_hit_rate
        rates.append((rate, evicted))
    assert rates[0][0] < rates[1][0] < rates[2][0]
    assert rates[0][1] > rates[1][1] > 0


def test_cache_mode_rejects_what_cannot_fit() -> None:
    workload = load_workload(TRACES["conversation"])
    analysis = analyze(workload, 512, output_blocks=False, reuse=False)
    small = analysis.max_request_blocks // 2
    result = run_fleet(workload, single_group_config(small + 1, 512), mode="cache")
    stats = result.replicas[0]
    too_large = sum(1 for r in workload.requests if -(-r.input_length // 512) > small)
    assert stats.rejected == too_large > 0
    assert stats.finished == len(workload.requests) - too_large


def test_chat_trace_hits_every_system_prompt_after_the_first() -> None:
    workload = chat_workload(64)
    analysis = analyze(workload, 16, output_blocks=False)
    # 8 system prompts of 1024 tokens; each request's first sight misses.
    assert analysis.ideal_hit_tokens == (64 - 8) * 1024
    rate, _ = _hit_rate(workload, analysis.total_blocks_allocated + 1, 16)
    assert rate == analysis.ideal_hit_rate


@pytest.mark.parametrize("small_pool", [False, True])
def test_engine_mode_serves_every_request(small_pool: bool) -> None:
    workload = load_workload(TRACES["conversation"]).limited(120)
    analysis = analyze(workload, 16, reuse=False)
    # The small pool holds the largest request and half as much again.
    blocks = analysis.max_request_blocks * 3 // 2 if small_pool else analysis.total_blocks_allocated + 1
    scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048)
    result = run_fleet(workload, single_group_config(blocks, 16), mode="engine", scheduler=scheduler)
    stats = result.replicas[0]
    assert stats.finished == stats.requests == len(workload.requests)
    assert stats.rejected == 0
    assert stats.prompt_tokens == workload.prompt_tokens
    assert 0 < stats.hit_tokens <= analysis.ideal_hit_tokens
    assert len(stats.queue_delay_ms) == len(stats.ttft_ms) == len(workload.requests)
    assert min(stats.queue_delay_ms) >= 0 and min(stats.ttft_ms) > 0
    # Every prompt token was either hit or computed (recomputed after a preemption).
    assert stats.prefill_tokens_computed >= workload.prompt_tokens - stats.hit_tokens
    if not small_pool:
        assert stats.preemptions == 0 and stats.evicted_blocks == 0
    else:
        assert stats.preemptions > 0
    assert result.span_ms >= workload.requests[-1].arrival_ms
    again = run_fleet(workload, single_group_config(blocks, 16), mode="engine", scheduler=scheduler)
    assert (again.replicas[0].hit_tokens, again.replicas[0].preemptions, again.span_ms) == (
        stats.hit_tokens, stats.preemptions, result.span_ms)


def test_engine_rejects_a_request_larger_than_the_pool() -> None:
    workload = load_workload(TRACES["synthetic"]).limited(30)
    largest = max(-(-(r.input_length + r.output_length) // 512) for r in workload.requests)
    result = run_fleet(workload, single_group_config(largest, 512), mode="engine",
                       scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096))
    stats = result.replicas[0]
    assert stats.rejected >= 1
    assert stats.finished + stats.rejected == len(workload.requests)


@pytest.mark.parametrize("mode", ["cache", "engine"])
def test_prefix_aware_router_sees_exactly_what_replicas_cache(mode: str) -> None:
    # The router's only input is the event stream; after the replay its
    # index must equal every replica's prefix-cache map.
    workload = load_workload(TRACES["conversation"]).limited(100)
    config = single_group_config(150, 512)
    router = PrefixAwareRouter()
    source = TokenSource(512)
    hasher = PrefixHasher("xxh3_128", 512, 512, "0")
    fleet = [Replica(i, config, 131072, hash_fn="xxh3_128", hash_seed="0",
                     scheduler=SchedulerConfig(), on_events=router.observe) for i in range(3)]
    predicted = actual = 0
    for number, trace_request in enumerate(workload.requests):
        request = SimRequest(f"r{number}", trace_request.block_ids, trace_request.input_length, source, hasher)
        before = router.matched_tokens
        chosen = router.choose(request, fleet, cache_mode=mode == "cache")
        if mode == "cache":
            hits = fleet[chosen].stats.hit_tokens
            fleet[chosen].serve_alone(request)
            # In cache mode the events are current: the predicted match is the hit.
            predicted += router.matched_tokens - before
            actual += fleet[chosen].stats.hit_tokens - hits
        else:
            for replica in fleet:
                replica.advance_to(trace_request.arrival_ms)
            fleet[chosen].submit(request, trace_request)
    for replica in fleet:
        replica.drain()
    assert predicted == actual
    for index, replica in enumerate(fleet):
        cached = {get_block_hash(BlockHashWithGroupId(key)) for key, _ in replica.manager.snapshot().pool.cached}
        announced = {key for key, mask in router.holders.items() if mask >> index & 1}
        assert announced == cached
        assert replica.stats.cached_blocks == len(cached)


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("mode", ["cache", "engine"])
def test_prefix_aware_routing_beats_round_robin(name: str, mode: str) -> None:
    workload = load_workload(TRACES[name])
    config = single_group_config(400, 512)
    rates = {}
    for router in ("round-robin", "least-loaded", "prefix-aware"):
        result = run_fleet(workload, config, mode=mode, replicas=4, router=router)
        assert sum(result.routed) == len(workload.requests)
        assert sum(s.finished for s in result.replicas) == len(workload.requests)
        rates[router] = sum(s.hit_tokens for s in result.replicas) / workload.prompt_tokens
    assert rates["prefix-aware"] > rates["round-robin"] + 0.1


def test_capacity_parsing() -> None:
    workload = load_workload(TRACES["synthetic"])
    analysis = analyze(workload, 512, reuse=False)
    caps = parse_capacities("1e6, 3M, 500k, 0.5x, inf, 1024", analysis, 512)
    assert [c.label for c in caps] == ["1e6", "3m", "500k", "0.5x", "inf", "1024"]
    assert caps[0].num_blocks == -(-10**6 // 512) + 1 and caps[1].num_blocks == -(-3 * 10**6 // 512) + 1
    assert caps[3].num_blocks == round(analysis.distinct_blocks * 0.5) + 1
    assert caps[4] == Capacity("inf", analysis.total_blocks_allocated + 1)
    assert caps[5].num_blocks == 3
    for bad in ("lots", "0x", "1e6tokens", ""):
        with pytest.raises(InvalidArgumentError, match="--capacity"):
            parse_capacities(bad, analysis, 512)


def test_capacity_for_share_interpolates_on_a_log_axis() -> None:
    from pagedkv.simulate.report import capacity_for_share

    runs = [{"replicas": 1, "capacity": c, "capacity_tokens": t, "hit_rate": r}
            for c, t, r in (("b", 10_000, 0.4), ("a", 100, 0.1), ("c", 1_000_000, 0.5))]
    runs.append({"replicas": 4, "capacity": "x", "capacity_tokens": 10, "hit_rate": 0.9})
    label, tokens, interpolated = capacity_for_share(runs, 0.25)
    assert (label, interpolated) == ("b", True) and tokens == pytest.approx(1000.0)
    assert capacity_for_share(runs, 0.05) == ("a", 100.0, False)
    assert capacity_for_share(runs, 0.6) == (None, None, False)
