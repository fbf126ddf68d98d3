"""Retention directives from vLLM requests (spec/retention.md §7, docs/retention.md).

Two carriers, one payload schema:

- ``request.kv_hints``: vLLM 0.33's envelope (``protocol_version``,
  ``message_id``, ``actions``), each action ``action_type`` /
  ``action_version`` / ``payload``. pagedkv defines three action types, all
  at version ``"1"``: ``pagedkv.retain`` (priorities for token ranges),
  ``pagedkv.pin`` and ``pagedkv.unpin``. Actions of other types are left to
  their owners (skipped).
- ``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``, whose
  entrypoint does not pass ``kv_hints``): the key ``"pagedkv_retention"``
  holding ``{"retain": PAYLOAD, "pin": PAYLOAD, "unpin": PAYLOAD}`` (any
  subset).

Payloads:

- retain: ``{"ranges": [{"start": int, "end": int | null, "priority": 0..100,
  "duration": seconds | null}, ...], "generated": {"priority": ...,
  "duration": ...} | absent, "tenant": str | absent}``;
- pin: ``{"num_tokens": int | null, "ttl": seconds | null}``;
- unpin: ``{}``.

Parsing is pure: a malformed directive raises :class:`InvalidRetentionError`
naming the field (``kv_hints.actions[0].payload.ranges[1].priority``) and
nothing anywhere changes. :func:`block_priorities` maps a request's ranges
onto its blocks (a block takes the range holding its first token; blocks
outside every range get the default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedkv.spec.errors import InvalidRetentionError
from pagedkv.spec.retention import (
    DEFAULT_PRIORITY,
    PinDirective,
    RetentionDirective,
    check_priority,
    check_seconds,
)

__all__ = ["ACTION_VERSION", "RETAIN", "PIN", "UNPIN", "XARGS_KEY", "RetentionHints", "parse_kv_hints",
           "parse_extra_args", "request_retention", "block_priorities", "RetentionPool", "apply_hints"]

RETAIN, PIN, UNPIN = "pagedkv.retain", "pagedkv.pin", "pagedkv.unpin"
ACTION_VERSION = "1"
XARGS_KEY = "pagedkv_retention"


@dataclass(frozen=True)
class RetentionHints:
    """A request's retention, parsed: prompt ranges, the generated tokens'
    directive, the tenant, a pin and whether to unpin."""

    ranges: tuple[RetentionDirective, ...] = ()
    generated: RetentionDirective | None = None
    tenant: str | None = None
    pin: PinDirective | None = None
    unpin: bool = False

    @property
    def empty(self) -> bool:
        """Whether the request carries no retention at all."""
        return not self.ranges and self.generated is None and self.pin is None and not self.unpin


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRetentionError(f"{where}: expected an object, got {value!r}")
    return value


def _known(payload: Mapping[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in payload if key not in keys)
    if unknown:
        raise InvalidRetentionError(f"{where}: unknown field(s) {unknown}; known: {sorted(keys)}")


def _directive(raw: object, where: str, *, whole: bool = False) -> RetentionDirective:
    entry = _mapping(raw, where)
    _known(entry, {"priority", "duration"} if whole else {"start", "end", "priority", "duration"}, where)
    start = 0 if whole else entry.get("start", 0)
    end = None if whole else entry.get("end")
    if type(start) is not int or start < 0:
        raise InvalidRetentionError(f"{where}.start: expected an int >= 0, got {start!r}")
    if end is not None and (type(end) is not int or end <= start):
        raise InvalidRetentionError(f"{where}.end: expected null or an int > start ({start}), got {end!r}")
    if "priority" not in entry:
        raise InvalidRetentionError(f"{where}.priority: missing")
    priority = check_priority(entry["priority"], f"{where}.priority")
    duration = check_seconds(entry.get("duration"), f"{where}.duration")
    return RetentionDirective(start, end, priority, duration)


def _retain(payload: Mapping[str, Any], where: str) -> tuple[tuple[RetentionDirective, ...],
                                                            RetentionDirective | None, str | None]:
    _known(payload, {"ranges", "generated", "tenant"}, where)
    raw_ranges = payload.get("ranges", [])
    if not isinstance(raw_ranges, list):
        raise InvalidRetentionError(f"{where}.ranges: expected a list, got {raw_ranges!r}")
    ranges = tuple(_directive(raw, f"{where}.ranges[{index}]") for index, raw in enumerate(raw_ranges))
    ordered = sorted(ranges, key=lambda directive: directive.start)
    for before, after in zip(ordered, ordered[1:]):
        if before.end is None or before.end > after.start:
            raise InvalidRetentionError(f"{where}.ranges: ranges overlap at token {after.start}")
    generated = None if payload.get("generated") is None else _directive(
        payload["generated"], f"{where}.generated", whole=True)
    tenant = payload.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InvalidRetentionError(f"{where}.tenant: expected a non-empty string, got {tenant!r}")
    return ranges, generated, tenant


def _pin(payload: Mapping[str, Any], where: str) -> PinDirective:
    _known(payload, {"num_tokens", "ttl"}, where)
    num_tokens = payload.get("num_tokens")
    if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 1):
        raise InvalidRetentionError(f"{where}.num_tokens: expected null or an int >= 1, got {num_tokens!r}")
    return PinDirective(num_tokens, check_seconds(payload.get("ttl"), f"{where}.ttl"))


def _combine(parts: Sequence[tuple[str, Mapping[str, Any], str]]) -> RetentionHints:
    """``(kind, payload, where)`` triples -> hints; each kind at most once."""
    seen: dict[str, str] = {}
    ranges: tuple[RetentionDirective, ...] = ()
    generated: RetentionDirective | None = None
    tenant: str | None = None
    pin: PinDirective | None = None
    unpin = False
    for kind, payload, where in parts:
        if kind in seen:
            raise InvalidRetentionError(f"{where}: a second {kind} directive (the first is {seen[kind]})")
        seen[kind] = where
        if kind == "retain":
            ranges, generated, tenant = _retain(payload, where)
        elif kind == "pin":
            pin = _pin(payload, where)
        else:
            _known(payload, set(), where)
            unpin = True
    if pin is not None and unpin:
        raise InvalidRetentionError(f"{seen['unpin']}: a request cannot both pin and unpin")
    return RetentionHints(ranges, generated, tenant, pin, unpin)


def parse_kv_hints(envelope: object, where: str = "kv_hints") -> RetentionHints:
    """The pagedkv actions of a ``KvHintsEnvelope`` (or any object with its
    attributes, or a dict of its fields); ``None`` gives empty hints.

    Raises:
        InvalidRetentionError: a pagedkv action malformed, of another version,
            or given twice (the message names the field).
    """
    if envelope is None:
        return RetentionHints()
    actions = envelope.get("actions") if isinstance(envelope, Mapping) else getattr(envelope, "actions", None)
    if not isinstance(actions, (list, tuple)):
        raise InvalidRetentionError(f"{where}.actions: expected a list, got {actions!r}")
    kinds = {RETAIN: "retain", PIN: "pin", UNPIN: "unpin"}
    parts = []
    for index, action in enumerate(actions):
        here = f"{where}.actions[{index}]"
        read = action.get if isinstance(action, Mapping) else (lambda name, a=action: getattr(a, name, None))
        action_type = read("action_type")
        if action_type not in kinds:
            continue  # another component's action
        version = read("action_version")
        if version != ACTION_VERSION:
            raise InvalidRetentionError(
                f"{here}.action_version: {action_type} is defined at version {ACTION_VERSION!r}, got {version!r}")
        payload = _mapping(read("payload"), f"{here}.payload")
        parts.append((kinds[action_type], payload, f"{here}.payload"))
    return _combine(parts)


def parse_extra_args(extra_args: Mapping[str, Any] | None, where: str = "extra_args") -> RetentionHints:
    """The ``"pagedkv_retention"`` entry of ``SamplingParams.extra_args``
    (``vllm_xargs``); absent gives empty hints.

    Raises:
        InvalidRetentionError: malformed (the message names the field).
    """
    if not extra_args or XARGS_KEY not in extra_args:
        return RetentionHints()
    here = f"{where}.{XARGS_KEY}"
    entry = _mapping(extra_args[XARGS_KEY], here)
    _known(entry, {"retain", "pin", "unpin"}, here)
    return _combine([(kind, _mapping(entry[kind], f"{here}.{kind}"), f"{here}.{kind}")
                     for kind in ("retain", "pin", "unpin") if kind in entry])


def request_retention(request: object, *, map_request_priority: bool = False) -> RetentionHints:
    """A vLLM request's retention: ``kv_hints`` if it carries pagedkv
    actions, else its sampling params' ``extra_args``. With
    ``map_request_priority`` (off by default), a request with no retain
    directive gets its whole prompt at ``35 - request.priority`` clamped to
    [0, 100] (vLLM schedules lower values first; its default 0 maps to 35).

    Raises:
        InvalidRetentionError: both carriers hold pagedkv directives, or one is malformed.
    """
    from_hints = parse_kv_hints(getattr(request, "kv_hints", None))
    params = getattr(request, "sampling_params", None)
    from_xargs = parse_extra_args(getattr(params, "extra_args", None))
    if not from_hints.empty and not from_xargs.empty:
        raise InvalidRetentionError("kv_hints and extra_args.pagedkv_retention: give retention in one of them")
    hints = from_xargs if from_hints.empty else from_hints
    priority = getattr(request, "priority", 0)
    if map_request_priority and not hints.ranges and type(priority) is int:
        mapped = min(100, max(0, DEFAULT_PRIORITY - priority))
        hints = RetentionHints((RetentionDirective(0, None, mapped),), hints.generated, hints.tenant, hints.pin,
                               hints.unpin)
    return hints


class RetentionPool(Protocol):
    """What :func:`apply_hints` needs of a pool (both ``RetentionBlockPool`` s)."""

    def retain(self, block_ids: Sequence[int], priority: int, duration: float | None = None,
               tenant: str | None = None) -> None: ...

    def pin(self, block_ids: Sequence[int], ttl: float | None = None) -> None: ...

    def unpin(self, block_ids: Sequence[int]) -> None: ...


def apply_hints(pool: RetentionPool, hints: RetentionHints, block_ids: Sequence[int], *, num_prompt_tokens: int,
                num_keyed_blocks: int, block_size: int) -> None:
    """Apply a request's hints to the blocks it holds (``block_ids``, in
    order; the first ``num_keyed_blocks`` carry keys): each block's directive
    (:func:`block_priorities`, grouped so each distinct directive is one
    call), then the pin of the first ``pin.num_tokens`` tokens' full keyed
    blocks (all keyed blocks when ``None``), or the unpin of the keyed blocks.

    Raises:
        PinBudgetExceededError: the pin passes the pool's budget (directives
            already applied stay; the pin changes nothing).
    """
    if hints.empty:
        return
    groups: dict[tuple[int, float | None], list[int]] = {}
    if hints.ranges or hints.generated is not None:
        for block, key in zip(block_ids, block_priorities(hints, num_prompt_tokens, len(block_ids), block_size)):
            if block:
                groups.setdefault(key, []).append(block)
    for (priority, duration), blocks in groups.items():
        pool.retain(blocks, priority, duration, hints.tenant)
    keyed = [block for block in block_ids[:num_keyed_blocks] if block]
    if hints.pin is not None:
        count = len(keyed) if hints.pin.num_tokens is None else min(len(keyed), hints.pin.num_tokens // block_size)
        if count:
            pool.pin(keyed[:count], hints.pin.ttl)
    elif hints.unpin:
        pool.unpin(keyed)


def block_priorities(hints: RetentionHints, num_prompt_tokens: int, num_blocks: int,
                     block_size: int) -> list[tuple[int, float | None]]:
    """``(priority, duration)`` of each of a request's first ``num_blocks``
    blocks: a block takes the range holding its first token (prompt blocks)
    or the generated tokens' directive (blocks starting at or past the
    prompt's end); blocks no directive covers get ``(35, None)``."""
    out: list[tuple[int, float | None]] = []
    for index in range(num_blocks):
        first = index * block_size
        found: tuple[int, float | None] = (DEFAULT_PRIORITY, None)
        if first >= num_prompt_tokens:
            if hints.generated is not None:
                found = (hints.generated.priority, hints.generated.duration)
        else:
            for directive in hints.ranges:
                if directive.start <= first and (directive.end is None or first < directive.end):
                    found = (directive.priority, directive.duration)
                    break
        out.append(found)
    return out
