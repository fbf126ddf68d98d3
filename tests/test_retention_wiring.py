"""Retention in the vLLM adapter (src/pagedkv/vllm/retention_wiring.py,
docs/retention.md "From vLLM"): how an engine turns it on (vLLM's
``additional_config`` or ``$PAGEDKV_RETENTION``), and how a request's parsed
directives reach the core manager's retention calls after its allocations
(RETM-1, RETM-2). Fake requests carry vLLM's attribute names; the last test
runs vLLM 0.33's own ``Request`` and manager where vLLM is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

import pagedkv.optimized as optimized
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidRetentionError
from pagedkv.spec.retention_config import RetentionConfig
from pagedkv.vllm.retention_wiring import (
    ENV_VAR,
    RequestRetention,
    RetentionSetup,
    parse_setup,
    setup_from_vllm,
)

BLOCK = 4


@dataclass
class Params:
    extra_args: dict[str, Any] | None = None


@dataclass
class FakeVllmRequest:
    """The attributes the wiring reads of vLLM's ``Request``."""

    request_id: str
    num_prompt_tokens: int
    kv_hints: Any = None
    sampling_params: Params = field(default_factory=Params)
    cache_salt: str | None = None
    priority: int = 0


@dataclass
class VllmConfig:
    additional_config: dict[str, Any] = field(default_factory=dict)


def core(num_blocks: int, config: RetentionConfig) -> Any:
    kv = KVCacheConfig(num_blocks, (), (KVCacheGroupSpec(("l0",), FullAttentionSpec(BLOCK, 1, 8, "float16")),))
    return optimized.KVCacheManager(kv, 64, retention=config, enable_kv_cache_events=True)


def test_off_unless_configured_and_additional_config_wins() -> None:
    assert setup_from_vllm(VllmConfig(), {}) is None
    env = {ENV_VAR: '{"policy": "priority", "pin_budget": 0.1}'}
    assert setup_from_vllm(VllmConfig(), env) == RetentionSetup(RetentionConfig("priority", 0.1))
    chosen = setup_from_vllm(VllmConfig({"pagedkv_retention": {"pin_budget": 0.5, "map_request_priority": True}}), env)
    assert chosen is not None and chosen.config.pin_budget == 0.5 and chosen.map_request_priority


@pytest.mark.parametrize("raw,message", [
    ("{", "not JSON"), ("[]", "expected an object"), ({"budget": 1}, "unknown field"),
    ({"pin_budget": 3}, r"pagedkv_retention: retention\.pin_budget"), ({"map_request_priority": 1}, "true or false"),
    ({"tenant_quotas": {"a": "x"}}, r"tenant_quotas\['a'\]"),
])
def test_a_bad_setting_names_its_field(raw: object, message: str) -> None:
    with pytest.raises(InvalidRetentionError, match=message):
        parse_setup(raw)


def _allocate(manager: Any, name: str, tokens: list[int]) -> Any:
    request = manager.make_request(name, tokens)
    hit, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(tokens) - num_hit, num_hit, hit if num_hit else None) is not None
    return request


def test_directives_and_the_pin_reach_the_pool_after_allocation() -> None:
    manager = core(16, RetentionConfig("priority", 0.5))
    wiring = RequestRetention(manager, RetentionSetup(RetentionConfig("priority", 0.5)))
    xargs = {"pagedkv_retention": {"retain": {"ranges": [{"start": 0, "end": 8, "priority": 90, "duration": 5}],
                                              "generated": {"priority": 10}},
                                   "pin": {"num_tokens": 8, "ttl": None}}}
    fake = FakeVllmRequest("a", 12, sampling_params=Params(xargs))
    _allocate(manager, "a", list(range(10, 22)))
    wiring.after_allocation(fake, 4)  # chunked: the pinned prefix (8 tokens) is not all cached yet
    ids = manager.get_block_ids("a")[0]
    records = dict(manager.retention_state()[1])
    assert records[ids[0]] == (90, 5.0) and records[ids[1]] == (90, 5.0) and records[ids[2]] == (35, None)
    assert manager.retention_state()[3] == [] and wiring.pins == 0
    wiring.after_allocation(fake, 12)
    assert [block for block, _ in manager.retention_state()[3]] == ids[:2] and wiring.pins == 1
    wiring.after_allocation(fake, 12)  # once per request
    assert manager.retention_counters()["pins_granted"] == 1


def test_bad_hints_and_refused_pins_are_counted_never_raised() -> None:
    manager = core(9, RetentionConfig("lru", 0.0))  # budget 0: every pin refused
    wiring = RequestRetention(manager, RetentionSetup(RetentionConfig("lru", 0.0)))
    _allocate(manager, "bad", list(range(10, 18)))
    _allocate(manager, "pin", list(range(30, 38)))
    before = manager.snapshot()
    wiring.after_allocation(FakeVllmRequest("bad", 8, sampling_params=Params(
        {"pagedkv_retention": {"retain": {"ranges": [{"start": 0, "priority": 101}]}}})), 8)
    wiring.after_allocation(FakeVllmRequest("pin", 8, sampling_params=Params({"pagedkv_retention": {"pin": {}}})), 8)
    assert (wiring.refused_directives, wiring.refused_pins, wiring.pins) == (1, 1, 0)
    assert manager.snapshot() == before and manager.retention_counters()["pins_refused"] == 1


def test_quotas_take_the_tenant_from_the_cache_salt() -> None:
    manager = core(16, RetentionConfig("lru", 0.0, {"acme": 1}))
    wiring = RequestRetention(manager, RetentionSetup(RetentionConfig("lru", 0.0, {"acme": 1})))
    request = manager.make_request("s", list(range(10, 22)), cache_salt="acme")
    assert manager.allocate_slots(request, 12) is not None
    wiring.after_allocation(FakeVllmRequest("s", 12, cache_salt="acme"), 12)
    manager.free(request)
    wiring.forget("s")
    assert sum(1 for block in manager.block_pool.free_queue_ids() if manager.block_pool.block_hashes[block]) == 1


def test_in_vllms_manager_a_pinned_prefix_outlives_a_flood() -> None:
    """vLLM 0.33's own Request through pagedkv.vllm.KVCacheManager: with the
    pin the system prompt still hits after unique prompts took every other
    block; without retention (and with lru alone) it is gone."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make verify-vllm)")
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFull
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmConfigType
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VllmGroup
    from vllm.v1.request import Request

    import pagedkv.vllm

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    system = list(range(100, 164))  # 4 blocks

    def run(retention: RetentionSetup | None) -> int:
        config = VllmConfigType(num_blocks=17, kv_cache_tensors=[], kv_cache_groups=[VllmGroup(
            ["full"], VllmFull(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16))])
        manager = pagedkv.vllm.KVCacheManager(config, 256, scheduler_block_size=16, hash_block_size=16,
                                              retention=retention)

        def serve(name: str, tokens: list[int], extra: dict[str, Any] | None = None) -> int:
            request = Request(name, tokens, SamplingParams(max_tokens=1, extra_args=extra), None,
                              block_hasher=hasher)
            blocks, hit = manager.get_computed_blocks(request)[:2]
            assert manager.allocate_slots(request, len(tokens) - hit, hit, blocks) is not None
            manager.free(request)
            return int(hit)

        serve("sys", system + [1, 2, 3], {"pagedkv_retention": {"pin": {"num_tokens": 64}}})
        for index in range(4):
            serve(f"u{index}", [1000 + 100 * index + t for t in range(64)])
        return serve("again", system + [4])

    assert run(None) == 0
    assert run(RetentionSetup(RetentionConfig("lru", 0.0))) == 0
    assert run(RetentionSetup(RetentionConfig("lru", 0.25))) == 64


def test_gate_the_pin_waits_for_its_prefix() -> None:
    """A wiring that pins at the first allocation, before a chunked prefill has cached the
    prefix, pins a part of it: the test above catches it."""
    original = RequestRetention.after_allocation

    def eager(self: RequestRetention, request: Any, num_cached_tokens: int) -> None:
        original(self, request, 10**9)  # the bug: every token counted as cached

    RequestRetention.after_allocation = eager  # type: ignore[method-assign]
    try:
        with pytest.raises(AssertionError):
            test_directives_and_the_pin_reach_the_pool_after_allocation()
    finally:
        RequestRetention.after_allocation = original  # type: ignore[method-assign]
