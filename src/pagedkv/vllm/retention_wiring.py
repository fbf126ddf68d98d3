"""Retention in a running vLLM engine (docs/retention.md, "From vLLM").

Turning it on: the scheduler (:class:`pagedkv.vllm.Scheduler`) reads
``additional_config["pagedkv_retention"]`` of vLLM's config
(``--additional-config '{"pagedkv_retention": {...}}'``) or, if absent, the
environment variable ``PAGEDKV_RETENTION`` (the same JSON), and builds the
manager with :class:`RetentionSetup`; without either nothing changes. A
manager built directly takes ``retention=RetentionSetup(...)`` (or a
``RetentionConfig``).

Applying it: :class:`RequestRetention` reads each request's directives once
(``kv_hints`` or ``extra_args``, :mod:`pagedkv.vllm.retention`) and, after
each allocation or delayed caching of the request, maps them onto the blocks
it holds through the core manager's retention calls: the ranges and the
generated-token directive whenever its block list grew, the pin (or unpin)
once the tokens it names are cached. A malformed directive or a pin past the
budget is logged and counted, never raised into vLLM's scheduler: retention
changes what stays cached, never what is computed, so the request runs on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedkv.spec.errors import InvalidRetentionError, PinBudgetExceededError
from pagedkv.spec.retention_config import RetentionConfig

from .retention import RetentionHints, request_retention

__all__ = ["ENV_VAR", "CONFIG_KEY", "RetentionSetup", "RequestRetention", "parse_setup", "setup_from_vllm"]

ENV_VAR = "PAGEDKV_RETENTION"
CONFIG_KEY = "pagedkv_retention"

_log = logging.getLogger("pagedkv.vllm.retention")


@dataclass(frozen=True)
class RetentionSetup:
    """The adapter's retention settings: the core's config and whether vLLM's
    request ``priority`` maps onto a retention priority (off by default)."""

    config: RetentionConfig = field(default_factory=RetentionConfig)
    map_request_priority: bool = False


def parse_setup(raw: object, where: str = CONFIG_KEY) -> RetentionSetup:
    """A :class:`RetentionSetup` from JSON text or a mapping with the keys
    ``policy``, ``pin_budget``, ``tenant_quotas``, ``map_request_priority``
    (all optional).

    Raises:
        InvalidRetentionError: malformed (the message names the field).
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as error:
            raise InvalidRetentionError(f"{where}: not JSON ({error})") from None
    if not isinstance(raw, Mapping):
        raise InvalidRetentionError(f"{where}: expected an object, got {raw!r}")
    known = {"policy", "pin_budget", "tenant_quotas", "map_request_priority"}
    unknown = sorted(str(key) for key in raw if key not in known)
    if unknown:
        raise InvalidRetentionError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    mapped = raw.get("map_request_priority", False)
    if type(mapped) is not bool:
        raise InvalidRetentionError(f"{where}.map_request_priority: expected true or false, got {mapped!r}")
    try:
        config = RetentionConfig(policy=raw.get("policy", "lru"), pin_budget=raw.get("pin_budget", 0.0),
                                 tenant_quotas=raw.get("tenant_quotas", {}))
    except InvalidRetentionError as error:
        raise InvalidRetentionError(f"{where}: {error}") from None
    return RetentionSetup(config, mapped)


def setup_from_vllm(vllm_config: Any, environ: Mapping[str, str] = os.environ) -> RetentionSetup | None:
    """The retention a vLLM engine asks for: ``additional_config["pagedkv_retention"]``,
    else ``$PAGEDKV_RETENTION``, else ``None`` (retention off).

    Raises:
        InvalidRetentionError: the setting is malformed (the engine does not start).
    """
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, Mapping) and CONFIG_KEY in additional:
        return parse_setup(additional[CONFIG_KEY], f"additional_config.{CONFIG_KEY}")
    if environ.get(ENV_VAR):
        return parse_setup(environ[ENV_VAR], f"${ENV_VAR}")
    return None


@dataclass
class _Applied:
    """What has been applied of one request's hints."""

    hints: RetentionHints
    tenant: str | None
    num_blocks: int = 0
    pin_done: bool = False


class RequestRetention:
    """Applies vLLM requests' retention directives to a core manager built
    with retention (``core.apply_retention``, ``pin_prefix``, ``unpin_prefix``).

    Counters (observation): ``refused_directives`` (malformed hints, logged
    and ignored), ``refused_pins`` (pins past the budget, logged; the pool
    counts them too), ``pins`` (prefix pins granted).
    """

    def __init__(self, core: Any, setup: RetentionSetup) -> None:
        self._core = core
        self._setup = setup
        self._tenants_from_salt = bool(setup.config.tenant_quotas)
        self._applied: dict[str, _Applied | None] = {}
        self.refused_directives = 0
        self.refused_pins = 0
        self.pins = 0

    def _state(self, request: Any) -> _Applied | None:
        request_id = request.request_id
        if request_id in self._applied:
            return self._applied[request_id]
        try:
            hints = request_retention(request, map_request_priority=self._setup.map_request_priority)
        except InvalidRetentionError as error:
            self.refused_directives += 1
            _log.warning("request %s: retention directives ignored: %s", request_id, error)
            hints = RetentionHints()
        tenant = hints.tenant
        if tenant is None and self._tenants_from_salt:
            tenant = getattr(request, "cache_salt", None) or None
        state = None if hints.empty and tenant is None else _Applied(hints, tenant)
        self._applied[request_id] = state
        return state

    def after_allocation(self, request: Any, num_cached_tokens: int) -> None:
        """Apply what is due once ``request`` holds its blocks and the first
        ``num_cached_tokens`` of its tokens are cached (or about to be)."""
        state = self._state(request)
        if state is None:
            return
        core, request_id, hints = self._core, request.request_id, state.hints
        if request_id not in core.coordinator.requests:
            return
        num_prompt_tokens = request.num_prompt_tokens
        num_blocks = len(core.coordinator.managers[0].req_to_blocks[request_id]) if core.coordinator.managers else 0
        if num_blocks > state.num_blocks and (hints.ranges or hints.generated is not None or state.tenant):
            try:
                core.apply_retention(request_id, hints.ranges, generated=hints.generated, tenant=state.tenant,
                                     num_prompt_tokens=num_prompt_tokens)
            except InvalidRetentionError as error:  # a block of another tenant: nothing changed
                self.refused_directives += 1
                _log.warning("request %s: retention directives ignored: %s", request_id, error)
                state.tenant, state.hints = None, RetentionHints(pin=hints.pin, unpin=hints.unpin)
        state.num_blocks = num_blocks
        if state.pin_done or (hints.pin is None and not hints.unpin):
            return
        wanted = num_prompt_tokens if hints.pin is None or hints.pin.num_tokens is None else min(
            hints.pin.num_tokens, num_prompt_tokens)
        if num_cached_tokens < wanted:
            return  # the prefix is not all cached yet (chunked prefill): next allocation
        state.pin_done = True
        if hints.pin is None:
            core.unpin_prefix(request_id, wanted)
            return
        try:
            if core.pin_prefix(request_id, wanted, hints.pin.ttl):
                self.pins += 1
        except PinBudgetExceededError as error:
            self.refused_pins += 1
            _log.warning("request %s: pin refused: %s", request_id, error)

    def forget(self, request_id: str) -> None:
        """The request is freed: its directives are read again if it returns (preemption)."""
        self._applied.pop(request_id, None)
