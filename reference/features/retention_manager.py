"""Retention at the manager (spec/retention.md, "Manager operations"),
stated simply.

The facade builds :class:`RetentionBlockPool` instead of the kernel's pool
when given a :class:`~pagedkv.spec.retention_config.RetentionConfig`
(:func:`make_pool`), and inherits :class:`RetentionOperations`: a request's
directives mapped onto the blocks it holds (RETM-1), the pin and unpin of
its cached prefix (RETM-2), and the pool's own retention calls. Each
operation checks everything first; a refused one changes nothing (the pool's
refused-pins counter aside, RET-6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.reference import validation
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features.retention import RetentionBlockPool
from pagedkv.spec.errors import InvalidRetentionError
from pagedkv.spec.retention import DEFAULT_PRIORITY, Policy, RetentionDirective, check_directives, check_seconds
from pagedkv.spec.retention_config import check_retention_config
from pagedkv.spec.stored_events import check_block_stored_events

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["RetentionOperations", "make_pool"]


def make_pool(retention: object, num_blocks: int, enable_caching: bool, *, enable_kv_cache_events: bool,
              num_groups: int, block_stored_events: str) -> BlockPool:
    """The kernel's pool, or with a retention config the retention pool
    (its quotas set; nothing else differs, RET-1). The reference has no fast
    path, so every call reaches the pool's overrides (RETM-3)."""
    config = check_retention_config(retention)
    if config is None:
        return BlockPool(num_blocks, enable_caching, enable_kv_cache_events=enable_kv_cache_events,
                         num_groups=num_groups, block_stored_events=block_stored_events)
    pool = RetentionBlockPool(num_blocks, enable_caching, policy=config.policy, pin_budget=config.pin_budget,
                              clock=config.clock, enable_kv_cache_events=enable_kv_cache_events,
                              num_groups=num_groups)
    pool.block_stored_events = check_block_stored_events(block_stored_events)
    for tenant, quota in sorted(config.tenant_quotas.items()):
        pool.set_tenant_quota(tenant, quota)
    return pool


def directive_of(ranges: Sequence[RetentionDirective], generated: RetentionDirective | None,
                 first_token: int, num_prompt_tokens: int) -> tuple[int, float | None]:
    """RETM-1: a block takes the range holding its first token (a prompt
    block) or the generated tokens' directive (a block starting at or past
    the prompt's end); any other block the default ``(35, None)``."""
    if first_token >= num_prompt_tokens:
        return (DEFAULT_PRIORITY, None) if generated is None else (generated.priority, generated.duration)
    for directive in ranges:
        if directive.start <= first_token and (directive.end is None or first_token < directive.end):
            return directive.priority, directive.duration
    return DEFAULT_PRIORITY, None


class RetentionOperations:
    """Mixed into the reference facade: the manager's retention calls."""

    coordinator: KVCacheCoordinator

    @property
    def retention_pool(self) -> RetentionBlockPool | None:
        """The retention pool, or ``None`` when retention is not configured."""
        pool = self.coordinator.block_pool
        return pool if isinstance(pool, RetentionBlockPool) else None

    def _retention(self) -> RetentionBlockPool:
        pool = self.retention_pool
        if pool is None:
            raise InvalidRetentionError(
                "retention is not configured: build the manager with retention=RetentionConfig(...)")
        return pool

    def _held(self, request_id: str) -> list[tuple[int, list[KVCacheBlock]]]:
        """Per group: its block size and the request's blocks."""
        validation.known(self.coordinator, request_id)
        return [(manager.block_size, manager.req_to_blocks[request_id]) for manager in self.coordinator.managers]

    def apply_retention(self, request_id: str, ranges: Sequence[RetentionDirective] = (), *,
                        generated: RetentionDirective | None = None, tenant: str | None = None,
                        num_prompt_tokens: int) -> None:
        """Apply a request's directives to every block it holds (RETM-1):
        one pool ``retain`` per group and distinct ``(priority, duration)``,
        in block order; with ``tenant`` every block joins it.

        Raises:
            InvalidRetentionError: retention not configured, a malformed
                argument, or a block of another tenant (no change).
            UnknownRequestError: the request holds no blocks.
        """
        pool = self._retention()
        checked = check_directives(ranges, generated, tenant, num_prompt_tokens)
        held = self._held(request_id)
        if not checked and generated is None and tenant is None:
            return
        for _, blocks in held:
            for block in blocks:
                if tenant is not None and not block.is_null and pool.tenant.get(block.block_id, tenant) != tenant:
                    raise InvalidRetentionError(f"tenant: block {block.block_id} belongs to tenant "
                                                f"{pool.tenant[block.block_id]!r}, not {tenant!r}")
        for block_size, blocks in held:
            calls: dict[tuple[int, float | None], list[int]] = {}
            for index, block in enumerate(blocks):
                if not block.is_null:
                    key = directive_of(checked, generated, index * block_size, num_prompt_tokens)
                    calls.setdefault(key, []).append(block.block_id)
            for (priority, duration), ids in calls.items():
                pool.retain(ids, priority, duration, tenant)

    def _prefix(self, request_id: str, num_tokens: int | None) -> list[int]:
        """RETM-2: per group, the request's leading cached blocks among those
        the first ``num_tokens`` tokens fill (all its cached blocks when
        ``None``); null blocks are skipped."""
        if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 1):
            raise InvalidRetentionError(f"num_tokens must be None or an int >= 1, got {num_tokens!r}")
        ids: list[int] = []
        for block_size, blocks in self._held(request_id):
            limit = len(blocks) if num_tokens is None else min(len(blocks), num_tokens // block_size)
            for block in blocks[:limit]:
                if block.is_null:
                    continue
                if block.block_hash is None:
                    break
                ids.append(block.block_id)
        return ids

    def pin_prefix(self, request_id: str, num_tokens: int | None = None, ttl: float | None = None) -> list[int]:
        """Pin the request's cached prefix (RETM-2) for ``ttl`` seconds
        (refreshed by hits; ``None``: until unpinned), all or none; returns
        the pinned block ids (none: nothing to pin, no call).

        Raises:
            InvalidRetentionError: retention not configured or an argument malformed.
            UnknownRequestError: the request holds no blocks.
            PinBudgetExceededError: the pin would pass the budget (RET-6; no
                block pinned, the refusal counted).
        """
        pool = self._retention()
        check_seconds(ttl, "ttl")
        ids = self._prefix(request_id, num_tokens)
        if ids:
            pool.pin(ids, ttl)
        return ids

    def unpin_prefix(self, request_id: str, num_tokens: int | None = None) -> list[int]:
        """End the pins of the request's cached prefix (RETM-2); returns the block ids named.

        Raises:
            InvalidRetentionError: retention not configured or ``num_tokens`` malformed.
            UnknownRequestError: the request holds no blocks.
        """
        pool = self._retention()
        ids = self._prefix(request_id, num_tokens)
        if ids:
            pool.unpin(ids)
        return ids

    def pin_blocks(self, block_ids: Sequence[int], ttl: float | None = None) -> None:
        """The pool's ``pin`` (RET-5, RET-6, RET-10)."""
        self._retention().pin(list(block_ids), ttl)

    def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        """The pool's ``unpin``."""
        self._retention().unpin(list(block_ids))

    def set_tenant_quota(self, tenant: str, quota: int | None) -> None:
        """The pool's ``set_tenant_quota`` (RET-8)."""
        self._retention().set_tenant_quota(tenant, quota)

    def set_retention_policy(self, policy: Policy) -> None:
        """The pool's ``set_policy``."""
        self._retention().set_policy(policy)

    def retention_counters(self) -> dict[str, int]:
        """Pins granted, pins refused, quota evictions."""
        granted, refused, evicted = self._retention().stats.as_tuple()
        return {"pins_granted": granted, "pins_refused": refused, "quota_evictions": evicted}

    def retention_state(self) -> tuple[object, ...]:
        """The pool's retention state (what lockstep compares)."""
        return self._retention().retention_state()
