"""How a manager is told to retain (spec/retention.md, "Manager operations"):
the opt-in configuration both ``KVCacheManager`` s take as ``retention=``.

Vocabulary only: a manager given ``retention=None`` (the default) builds the
plain pool and never consults a policy; given a :class:`RetentionConfig` it
builds its ``RetentionBlockPool`` with these settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pagedkv.spec.errors import InvalidRetentionError
from pagedkv.spec.retention import Policy, check_pin_budget, check_policy, check_quota

__all__ = ["RetentionConfig", "check_retention_config"]


@dataclass(frozen=True)
class RetentionConfig:
    """A manager's retention settings.

    Attributes:
        policy: ``"lru"`` (vLLM's order; with no pins or quotas every block id
            and event is unchanged, RET-1) or ``"priority"``.
        pin_budget: share of the usable pool pins may hold, in ``[0, 1]``
            (0: pins off, every pin refused).
        tenant_quotas: tenant -> most free cached blocks it keeps (RET-8).
        clock: seconds, monotonic; injected so tests control time.

    Raises:
        InvalidRetentionError: a field is malformed (the message names it).
    """

    policy: Policy = "lru"
    pin_budget: float = 0.0
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        check_policy(self.policy, "retention.policy")
        check_pin_budget(self.pin_budget, "retention.pin_budget")
        if not isinstance(self.tenant_quotas, Mapping):
            raise InvalidRetentionError(
                f"retention.tenant_quotas must be a mapping of tenant to quota, got {self.tenant_quotas!r}")
        for tenant, quota in self.tenant_quotas.items():
            if type(tenant) is not str or not tenant:
                raise InvalidRetentionError(
                    f"retention.tenant_quotas: a tenant must be a non-empty str, got {tenant!r}")
            if check_quota(quota, f"retention.tenant_quotas[{tenant!r}]") is None:
                raise InvalidRetentionError(f"retention.tenant_quotas[{tenant!r}] must be an int >= 0, got None")
        if not callable(self.clock):
            raise InvalidRetentionError(f"retention.clock must be callable, got {self.clock!r}")
        object.__setattr__(self, "tenant_quotas", dict(self.tenant_quotas))


def check_retention_config(retention: object) -> RetentionConfig | None:
    """``retention`` if it is ``None`` or a :class:`RetentionConfig`; else
    :class:`InvalidRetentionError` naming the argument."""
    if retention is None or isinstance(retention, RetentionConfig):
        return retention
    raise InvalidRetentionError(f"retention must be None or a RetentionConfig, got {retention!r}")
