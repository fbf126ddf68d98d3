"""Retention vocabulary (spec/retention.md): policy names, priority bounds,
the directive types a request carries, and their argument checks.

Vocabulary only: the rules that rank blocks, decay priorities, pin and
enforce quotas live in ``reference/features/retention.py`` and
``optimized/pool/retention.py``. The checks here only refuse malformed values,
naming the field, before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pagedkv.spec.errors import InvalidRetentionError

__all__ = [
    "DEFAULT_PRIORITY",
    "FREQ_EXTENSION",
    "FREQ_LEVELS",
    "FREQ_MEMORY",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "POLICIES",
    "Policy",
    "RetentionDirective",
    "PinDirective",
    "check_directives",
    "check_policy",
    "check_pin_budget",
    "check_seconds",
    "check_priority",
    "check_quota",
]

#: Priority of a block no directive covers (TensorRT-LLM's default too).
DEFAULT_PRIORITY = 35
MIN_PRIORITY = 0
MAX_PRIORITY = 100

#: ``lru``: vLLM 0.33's order, priorities ignored (the default);
#: ``priority``: lowest effective priority first, least recently freed within it;
#: ``lru-freq``: LRU with deadlines extended by how often a key was released (RET-11).
Policy = Literal["lru", "priority", "lru-freq"]
POLICIES: tuple[Policy, ...] = ("lru", "priority", "lru-freq")

#: ``lru-freq`` (spec/retention.md section 6): a released key's level is
#: ``min(floor(log2(releases)), FREQ_LEVELS - 1)``; each level pushes its
#: deadline ``FREQ_EXTENSION`` (numerator, denominator) of the usable pool
#: further; releases are remembered for the last ``FREQ_MEMORY`` x usable
#: keys released. Chosen by measurement (bench/results/retention_policies.md).
FREQ_LEVELS = 4
FREQ_EXTENSION = (3, 4)
FREQ_MEMORY = 2


def check_policy(policy: object, field: str = "policy") -> Policy:
    """``policy`` if it names a policy; else :class:`InvalidRetentionError`."""
    if isinstance(policy, str) and policy in POLICIES:
        return policy
    raise InvalidRetentionError(f"{field} must be one of {list(POLICIES)}, got {policy!r}")


def check_priority(priority: object, field: str = "priority") -> int:
    """An int in ``[MIN_PRIORITY, MAX_PRIORITY]``; else :class:`InvalidRetentionError`."""
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRetentionError(
            f"{field} must be an int in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return priority


def check_seconds(seconds: object, field: str) -> float | None:
    """``None`` (no limit) or a finite number of seconds >= 0."""
    if seconds is None:
        return None
    if not isinstance(seconds, (int, float)) or type(seconds) is bool or not math.isfinite(seconds) or seconds < 0:
        raise InvalidRetentionError(f"{field} must be None or a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def check_pin_budget(budget: object, field: str = "pin_budget") -> float:
    """A share of the pool in ``[0, 1]``."""
    if not isinstance(budget, (int, float)) or type(budget) is bool or not 0 <= budget <= 1:
        raise InvalidRetentionError(f"{field} must be a number in [0, 1], got {budget!r}")
    return float(budget)


def check_quota(quota: object, field: str = "quota") -> int | None:
    """``None`` (no cap) or an int >= 0 of free cached blocks."""
    if quota is not None and (type(quota) is not int or quota < 0):
        raise InvalidRetentionError(f"{field} must be None or an int >= 0, got {quota!r}")
    return quota


@dataclass(frozen=True)
class RetentionDirective:
    """Priority for the prompt tokens ``[start, end)`` (``end=None``: to the
    prompt's end), lasting ``duration`` seconds after the block's last
    release (``None``: until evicted by a lower-or-equal rank).

    Raises:
        InvalidRetentionError: a field is malformed (the message names it).
    """

    start: int
    end: int | None
    priority: int
    duration: float | None = None

    def __post_init__(self) -> None:
        if type(self.start) is not int or self.start < 0:
            raise InvalidRetentionError(f"start must be an int >= 0, got {self.start!r}")
        if self.end is not None and (type(self.end) is not int or self.end <= self.start):
            raise InvalidRetentionError(f"end must be None or an int > start ({self.start}), got {self.end!r}")
        check_priority(self.priority)
        check_seconds(self.duration, "duration")


@dataclass(frozen=True)
class PinDirective:
    """Pin the request's first ``num_tokens`` prompt tokens (``None``: the
    whole prompt's full blocks) for ``ttl`` seconds, refreshed on every hit
    (``None``: until unpinned).

    Raises:
        InvalidRetentionError: a field is malformed (the message names it).
    """

    num_tokens: int | None = None
    ttl: float | None = None

    def __post_init__(self) -> None:
        if self.num_tokens is not None and (type(self.num_tokens) is not int or self.num_tokens < 1):
            raise InvalidRetentionError(f"num_tokens must be None or an int >= 1, got {self.num_tokens!r}")
        check_seconds(self.ttl, "ttl")


def check_directives(ranges: object, generated: object, tenant: object,
                     num_prompt_tokens: object) -> tuple[RetentionDirective, ...]:
    """The arguments of a manager's ``apply_retention``, checked (the message
    names the field): ``ranges`` a sequence of non-overlapping directives,
    ``generated`` one or ``None``, ``tenant`` ``None`` or a non-empty str,
    ``num_prompt_tokens`` an int >= 0. Returns ``ranges`` as a tuple."""
    if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Sequence):
        raise InvalidRetentionError(f"ranges must be a sequence of RetentionDirective, got {ranges!r}")
    checked = tuple(ranges)
    for index, directive in enumerate(checked):
        if not isinstance(directive, RetentionDirective):
            raise InvalidRetentionError(f"ranges[{index}] must be a RetentionDirective, got {directive!r}")
    ordered = sorted(checked, key=lambda directive: directive.start)
    for before, after in zip(ordered, ordered[1:]):
        if before.end is None or before.end > after.start:
            raise InvalidRetentionError(f"ranges: ranges overlap at token {after.start}")
    if generated is not None and not isinstance(generated, RetentionDirective):
        raise InvalidRetentionError(f"generated must be None or a RetentionDirective, got {generated!r}")
    if tenant is not None and (type(tenant) is not str or not tenant):
        raise InvalidRetentionError(f"tenant must be None or a non-empty str, got {tenant!r}")
    if type(num_prompt_tokens) is not int or num_prompt_tokens < 0:
        raise InvalidRetentionError(f"num_prompt_tokens must be an int >= 0, got {num_prompt_tokens!r}")
    return checked
