"""Retention at the manager (spec/retention.md, "Manager operations").

Semantic model: as ``reference/features/retention_manager.py``: with a
:class:`~pagedkv.spec.retention_config.RetentionConfig` the facade builds the
retention pool (:func:`make_pool`) and its calls map a request's directives
onto the blocks it holds (RETM-1) and pin or unpin its cached prefix (RETM-2).

The fast paths take blocks from and return blocks to the free queue
directly (the admission and decode steps, the C release and its Python
twin), so they would bypass the pool's victim choice and its release
bookkeeping. :func:`route_to_general_paths` turns them off, as the facade
does for re-prefilled tokens: every call then runs the general path, whose
pool calls the retention pool overrides (RETM-3, D-RET-10).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.retention import RetentionBlockPool
from pagedkv.spec.errors import InvalidRetentionError
from pagedkv.spec.retention import DEFAULT_PRIORITY, Policy, RetentionDirective, check_directives, check_seconds
from pagedkv.spec.retention_config import RetentionConfig, check_retention_config
from pagedkv.spec.stored_events import check_block_stored_events

from . import validation

__all__ = ["RetentionOperations", "make_pool", "route_to_general_paths"]


def make_pool(retention: RetentionConfig | None, num_blocks: int, enable_caching: bool, *,
              enable_kv_cache_events: bool, num_groups: int, block_stored_events: str) -> BlockPool:
    """The kernel's pool, or with a retention config the retention pool
    (its quotas set). Cost: O(num_blocks)."""
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


def route_to_general_paths(coordinator: KVCacheCoordinator) -> Callable[[str], None]:
    """Turn off every path that moves blocks past the pool's overridden
    calls: the decode and admission steps, and the release in C (the
    coordinator's own, which an adapter may call, and the facade's, which
    takes the returned release): the base class's release frees through
    ``BlockPool.free_held`` (RETM-3). Cost: O(1)."""
    coordinator.decode_step = coordinator.admit_step = None
    general = partial(KVCacheCoordinator.release, coordinator)
    coordinator.release = general  # type: ignore[method-assign]  # an instance's own, shadowing the kind's
    return general


class RetentionOperations:
    """Mixed into the optimized facade: the manager's retention calls."""

    _coordinator: KVCacheCoordinator

    @property
    def retention_pool(self) -> RetentionBlockPool | None:
        """The retention pool, or ``None`` when retention is not configured. Cost: O(1)."""
        pool = self._coordinator.block_pool
        return pool if isinstance(pool, RetentionBlockPool) else None

    def _retention(self) -> RetentionBlockPool:
        pool = self.retention_pool
        if pool is None:
            raise InvalidRetentionError(
                "retention is not configured: build the manager with retention=RetentionConfig(...)")
        return pool

    def _held(self, request_id: str) -> list[tuple[int, list[int]]]:
        validation.known(self._coordinator, request_id)
        return [(manager.block_size, manager.req_to_blocks[request_id]) for manager in self._coordinator.managers]

    def apply_retention(self, request_id: str, ranges: Sequence[RetentionDirective] = (), *,
                        generated: RetentionDirective | None = None, tenant: str | None = None,
                        num_prompt_tokens: int) -> None:
        """Apply a request's directives to the blocks it holds (RETM-1); see
        the reference. Cost: O(blocks held x ranges).

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
        if tenant is not None:
            owners = pool.tenant
            for _, blocks in held:
                for block in blocks:
                    if block and owners.get(block, tenant) != tenant:
                        raise InvalidRetentionError(
                            f"tenant: block {block} belongs to tenant {owners[block]!r}, not {tenant!r}")
        ordered = sorted(checked, key=lambda directive: directive.start)
        for block_size, blocks in held:
            calls: dict[tuple[int, float | None], list[int]] = {}
            for index, block in enumerate(blocks):
                if not block:
                    continue
                first = index * block_size
                key: tuple[int, float | None] = (DEFAULT_PRIORITY, None)
                if first >= num_prompt_tokens:
                    if generated is not None:
                        key = (generated.priority, generated.duration)
                else:
                    for directive in ordered:
                        if directive.start > first:
                            break
                        if directive.end is None or first < directive.end:
                            key = (directive.priority, directive.duration)
                            break
                calls.setdefault(key, []).append(block)
            for (priority, duration), ids in calls.items():
                pool.retain(ids, priority, duration, tenant)

    def _prefix(self, request_id: str, num_tokens: int | None) -> list[int]:
        if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 1):
            raise InvalidRetentionError(f"num_tokens must be None or an int >= 1, got {num_tokens!r}")
        hashes = self._coordinator.block_pool.block_hashes
        ids: list[int] = []
        for block_size, blocks in self._held(request_id):
            limit = len(blocks) if num_tokens is None else min(len(blocks), num_tokens // block_size)
            for block in blocks[:limit]:
                if not block:
                    continue
                if hashes[block] is None:
                    break
                ids.append(block)
        return ids

    def pin_prefix(self, request_id: str, num_tokens: int | None = None, ttl: float | None = None) -> list[int]:
        """Pin the request's cached prefix (RETM-2), all or none; returns the
        pinned block ids. Cost: O(blocks held + log n per block pinned).

        Raises:
            InvalidRetentionError: retention not configured or an argument malformed.
            UnknownRequestError: the request holds no blocks.
            PinBudgetExceededError: past the budget (RET-6; no change but the counter).
        """
        pool = self._retention()
        check_seconds(ttl, "ttl")
        ids = self._prefix(request_id, num_tokens)
        if ids:
            pool.pin(ids, ttl)
        return ids

    def unpin_prefix(self, request_id: str, num_tokens: int | None = None) -> list[int]:
        """End the pins of the request's cached prefix (RETM-2); returns the ids named."""
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
        """Pins granted, pins refused, quota evictions. Cost: O(1)."""
        pool = self._retention()
        return {"pins_granted": pool.pins_granted, "pins_refused": pool.pins_refused,
                "quota_evictions": pool.quota_evictions}

    def retention_state(self) -> tuple[object, ...]:
        """The pool's retention state (what lockstep compares)."""
        return self._retention().retention_state()
