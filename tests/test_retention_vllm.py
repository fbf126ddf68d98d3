"""Retention from vLLM requests: kv_hints actions and vllm_xargs
(src/pagedkv/vllm/retention.py, spec/retention.md §7). A malformed directive
raises InvalidRetentionError naming the field; a pool given hints changes
only through them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pagedkv.spec.errors import InvalidRetentionError
from pagedkv.spec.retention import PinDirective, RetentionDirective
from pagedkv.vllm.retention import (
    RetentionHints,
    block_priorities,
    parse_extra_args,
    parse_kv_hints,
    request_retention,
)


@dataclass(frozen=True)
class Action:
    """The shape of vLLM 0.33's KvHintAction."""

    action_id: str
    action_type: str
    action_version: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Envelope:
    """The shape of vLLM 0.33's KvHintsEnvelope."""

    protocol_version: str
    message_id: str
    actions: list[Action]


@dataclass
class FakeRequest:
    kv_hints: Envelope | None = None
    sampling_params: Any = None


@dataclass
class Params:
    extra_args: dict[str, Any] | None = field(default=None)


RETAIN = {"ranges": [{"start": 0, "end": 4096, "priority": 90, "duration": 600}],
          "generated": {"priority": 10}, "tenant": "acme"}


def envelope(*actions: tuple[str, str, dict[str, Any]]) -> Envelope:
    return Envelope("1", "m", [Action(f"a{i}", kind, version, payload)
                               for i, (kind, version, payload) in enumerate(actions)])


def test_kv_hints_actions_parse() -> None:
    hints = parse_kv_hints(envelope(("pagedkv.retain", "1", RETAIN), ("pagedkv.pin", "1", {"ttl": 30}),
                                    ("other.thing", "7", {"x": 1})))
    assert hints == RetentionHints((RetentionDirective(0, 4096, 90, 600.0),), RetentionDirective(0, None, 10),
                                   "acme", PinDirective(None, 30.0), False)


def test_the_real_envelope_type_if_vllm_is_installed() -> None:
    protocol = pytest.importorskip("vllm.v1.kv_hints.protocol")
    real = protocol.KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        protocol.KvHintAction(action_id="a", action_type="pagedkv.unpin", action_version="1", payload={})])
    assert parse_kv_hints(real).unpin


def test_vllm_xargs_parse_and_one_carrier_only() -> None:
    xargs = {"pagedkv_retention": {"retain": RETAIN, "unpin": {}}}
    hints = parse_extra_args(xargs)
    assert hints.unpin and hints.ranges[0].priority == 90
    assert request_retention(FakeRequest(None, Params(xargs))) == hints
    with pytest.raises(InvalidRetentionError, match="one of them"):
        request_retention(FakeRequest(envelope(("pagedkv.pin", "1", {})), Params(xargs)))
    assert request_retention(FakeRequest()).empty


@pytest.mark.parametrize("payload,field_name", [
    ({"ranges": [{"start": 0, "priority": 101}]}, r"ranges\[0\]\.priority"),
    ({"ranges": [{"start": -1, "priority": 5}]}, r"ranges\[0\]\.start"),
    ({"ranges": [{"start": 8, "end": 8, "priority": 5}]}, r"ranges\[0\]\.end"),
    ({"ranges": [{"start": 0, "priority": 5, "duration": -1}]}, r"ranges\[0\]\.duration"),
    ({"ranges": [{"start": 0, "priority": 5, "colour": 1}]}, r"ranges\[0\]: unknown"),
    ({"ranges": [{"start": 0, "end": 10, "priority": 5}, {"start": 5, "priority": 6}]}, r"ranges: ranges overlap"),
    ({"ranges": [{"start": 0}]}, r"ranges\[0\]\.priority: missing"),
    ({"tenant": 3}, r"tenant"),
    ({"generated": {"priority": "high"}}, r"generated\.priority"),
])
def test_a_bad_retain_names_its_field(payload: dict[str, Any], field_name: str) -> None:
    with pytest.raises(InvalidRetentionError, match=r"kv_hints\.actions\[0\]\.payload\." + field_name
                       if not field_name.startswith("ranges: ") else field_name):
        parse_kv_hints(envelope(("pagedkv.retain", "1", payload)))


def test_bad_versions_pins_and_duplicates_are_refused() -> None:
    with pytest.raises(InvalidRetentionError, match="action_version"):
        parse_kv_hints(envelope(("pagedkv.pin", "2", {})))
    with pytest.raises(InvalidRetentionError, match=r"payload\.num_tokens"):
        parse_kv_hints(envelope(("pagedkv.pin", "1", {"num_tokens": 0})))
    with pytest.raises(InvalidRetentionError, match=r"payload\.ttl"):
        parse_kv_hints(envelope(("pagedkv.pin", "1", {"ttl": "forever"})))
    with pytest.raises(InvalidRetentionError, match="second pin"):
        parse_kv_hints(envelope(("pagedkv.pin", "1", {}), ("pagedkv.pin", "1", {})))
    with pytest.raises(InvalidRetentionError, match="both pin and unpin"):
        parse_extra_args({"pagedkv_retention": {"pin": {}, "unpin": {}}})
    with pytest.raises(InvalidRetentionError, match=r"extra_args\.pagedkv_retention: unknown"):
        parse_extra_args({"pagedkv_retention": {"keep": {}}})


def test_block_priorities_take_the_range_of_each_blocks_first_token() -> None:
    hints = parse_extra_args({"pagedkv_retention": {"retain": {
        "ranges": [{"start": 0, "end": 6, "priority": 90}, {"start": 6, "priority": 50, "duration": 5}],
        "generated": {"priority": 10}}}})
    # Blocks of 4 tokens over a 10-token prompt, then generated tokens.
    assert block_priorities(hints, 10, 4, 4) == [(90, None), (90, None), (50, 5.0), (10, None)]
    assert block_priorities(RetentionHints(), 10, 2, 4) == [(35, None), (35, None)]


def test_hints_drive_a_retention_pool_and_a_refusal_changes_nothing() -> None:
    from tests.retention_twins import RetentionTwins
    twins = RetentionTwins(9)
    assert twins.allocate("r", 3)
    twins.cache("r")
    hints = parse_kv_hints(envelope(("pagedkv.retain", "1", RETAIN)))
    name = "r"
    for priority, duration in set(block_priorities(hints, 6, 3, 2)):
        twins.retain(name, priority, duration, hints.tenant)
    assert sorted(p for p, _ in dict(twins.opt.retention_state()[1]).values()) == [90, 90, 90]  # type: ignore[call-overload]
    before = twins.opt.retention_state()
    with pytest.raises(InvalidRetentionError):
        parse_kv_hints(envelope(("pagedkv.retain", "1", {"ranges": [{"start": 0, "priority": 900}]})))
    assert twins.opt.retention_state() == before


@dataclass
class PriorityRequest:
    priority: int
    kv_hints: Envelope | None = None
    sampling_params: Any = None


def test_request_priority_maps_only_when_asked() -> None:
    assert request_retention(PriorityRequest(-20)).empty
    mapped = request_retention(PriorityRequest(-20), map_request_priority=True)
    assert mapped.ranges == (RetentionDirective(0, None, 55),)
    assert request_retention(PriorityRequest(500), map_request_priority=True).ranges[0].priority == 0
    explicit = request_retention(PriorityRequest(-20, envelope(("pagedkv.retain", "1", RETAIN))),
                                 map_request_priority=True)
    assert explicit.ranges[0].priority == 90  # an explicit directive wins


def test_apply_hints_retains_pins_and_unpins_a_requests_blocks_on_both_pools() -> None:
    from pagedkv.vllm.retention import apply_hints
    from tests.retention_twins import RetentionTwins
    twins = RetentionTwins(17, pin_budget=0.25)  # 4 blocks may be pinned
    assert twins.allocate("r", 4)
    twins.cache("r")
    ids = twins.holdings["r"]
    hints = parse_kv_hints(envelope(
        ("pagedkv.retain", "1", {"ranges": [{"start": 0, "end": 4, "priority": 90}], "generated": {"priority": 5}}),
        ("pagedkv.pin", "1", {"num_tokens": 4, "ttl": 10})))
    for pool in (twins.ref, twins.opt):
        apply_hints(pool, hints, ids, num_prompt_tokens=6, num_keyed_blocks=4, block_size=2)
    twins.check()
    assert [twins.opt.retention_state()[1][i][1][0] for i in range(4)] == [90, 90, 35, 5]  # type: ignore[index]
    assert sorted(twins.opt.pins) == sorted(ids[:2])
    unpin = parse_extra_args({"pagedkv_retention": {"unpin": {}}})
    for pool in (twins.ref, twins.opt):
        apply_hints(pool, unpin, ids, num_prompt_tokens=6, num_keyed_blocks=4, block_size=2)
    twins.check()
    assert not twins.opt.pins
