"""A reference and an optimized retention pool driven alike (spec/retention.md).

:class:`RetentionTwins` holds both pools on one injected clock and applies
each operation to both: the same result or the same error type, then the same
snapshot (free queue order, keys, events), the same retention state, the same
allocatable count, and both sides' ``check_retention`` (RET-2..RET-8). The
lockstep machine and the planted-bug scenarios share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.optimized.pool.retention import RetentionBlockPool as OptimizedPool
from pagedkv.optimized.pool.retention import check_retention as check_optimized
from pagedkv.reference.features.retention import RetentionBlockPool as ReferencePool
from pagedkv.reference.features.retention import check_retention as check_reference
from pagedkv.spec.retention import Policy

__all__ = ["FakeRequest", "RetentionTwins", "BLOCK_SIZE"]

BLOCK_SIZE = 2


@dataclass
class FakeRequest:
    """The request fields a pool's ``BlockStored`` event reads."""

    all_token_ids: list[int]
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[object, ...] = ()


@dataclass
class Clock:
    """The injected clock both pools read."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class RetentionTwins:
    """Both pools, and what the driver holds: ``holdings`` (name -> block ids)."""

    num_blocks: int
    policy: Policy = "priority"
    pin_budget: float = 0.25
    clock: Clock = field(default_factory=Clock)
    holdings: dict[str, list[int]] = field(default_factory=dict)
    next_hash: int = 0

    def __post_init__(self) -> None:
        self.ref = ReferencePool(self.num_blocks, True, policy=self.policy, pin_budget=self.pin_budget,
                                 clock=self.clock, enable_kv_cache_events=True)
        self.opt = OptimizedPool(self.num_blocks, True, policy=self.policy, pin_budget=self.pin_budget,
                                 clock=self.clock, enable_kv_cache_events=True)

    # -- applying an operation to both ----------------------------------------

    def both(self, on_ref: Callable[[ReferencePool], Any], on_opt: Callable[[OptimizedPool], Any]) -> Any:
        """Run on both; the same error type or the same result (block ids)."""
        ref_outcome, opt_outcome = self._outcome(lambda: on_ref(self.ref)), self._outcome(lambda: on_opt(self.opt))
        if ref_outcome[0] == "ok" and isinstance(ref_outcome[1], list):
            ref_outcome = ("ok", [getattr(b, "block_id", b) for b in ref_outcome[1]])
        assert ref_outcome == opt_outcome, f"reference {ref_outcome} != optimized {opt_outcome}"
        self.check()
        return opt_outcome

    @staticmethod
    def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
        try:
            return ("ok", call())
        except Exception as error:  # noqa: BLE001 - compared by type across the twins
            return ("error", type(error))

    def check(self) -> None:
        """Same observable state on both sides; both checkers pass."""
        check_reference(self.ref)
        check_optimized(self.opt)
        assert self.ref.snapshot() == self.opt.snapshot(), "snapshots differ"
        assert self.ref.retention_state() == self.opt.retention_state(), (
            f"retention state: reference {self.ref.retention_state()} != optimized {self.opt.retention_state()}")
        assert self.ref.get_num_free_blocks() == self.opt.get_num_free_blocks()

    def _ref_blocks(self, ids: Sequence[int]) -> list[Any]:
        return [self.ref.blocks[block_id] for block_id in ids]

    # -- operations ------------------------------------------------------------

    def allocate(self, name: str, count: int) -> bool:
        """Take ``count`` new blocks as holding ``name``; whether it succeeded."""
        outcome = self.both(lambda p: p.get_new_blocks(count), lambda p: p.get_new_blocks(count))
        if outcome[0] == "ok":
            self.holdings[name] = list(outcome[1])
            return True
        return False

    def cache(self, name: str, hashes: list[bytes] | None = None) -> list[bytes]:
        """Give every unkeyed block of a holding a key: fresh ones (one per
        position) or ``hashes`` (a prefix computed again); the keys given."""
        ids = self.holdings[name]
        if hashes is None:
            hashes = []
            for _ in ids:
                hashes.append(f"h{self.next_hash}".encode())
                self.next_hash += 1
        request = FakeRequest(list(range(len(ids) * BLOCK_SIZE)))
        kwargs = dict(block_hashes=hashes, num_cached_blocks=0, num_full_blocks=len(ids),
                      block_size=BLOCK_SIZE, group_id=0)
        self.both(lambda p: p.cache_full_blocks(request, self._ref_blocks(ids), **kwargs),  # type: ignore[arg-type]
                  lambda p: p.cache_full_blocks(request, ids, **kwargs))  # type: ignore[arg-type]
        return hashes

    def hit(self, name: str, ids: Sequence[int]) -> None:
        """Touch blocks (a prefix hit) as holding ``name``."""
        self.both(lambda p: p.touch(self._ref_blocks(ids)), lambda p: p.touch(list(ids)))
        self.holdings[name] = list(ids)

    def free(self, name: str) -> None:
        """Release a holding, tail first (as a request's blocks are freed)."""
        ids = list(reversed(self.holdings.pop(name)))
        self.both(lambda p: p.free_blocks(self._ref_blocks(ids)), lambda p: p.free_blocks(ids))

    def release_to_back(self, name: str) -> None:
        """Release a holding to the back of the queue (D-HOST-18's path)."""
        ids = self.holdings.pop(name)
        self.both(lambda p: p.release_to_back(self._ref_blocks(ids)), lambda p: p.release_to_back(ids))

    def retain(self, name: str, priority: int, duration: float | None, tenant: str | None = None) -> None:
        """A directive on a holding's blocks."""
        ids = self.holdings[name]
        self.both(lambda p: p.retain(ids, priority, duration, tenant),
                  lambda p: p.retain(ids, priority, duration, tenant))

    def pin(self, ids: Sequence[int], ttl: float | None) -> None:
        """Pin blocks (may be refused as a whole)."""
        self.both(lambda p: p.pin(list(ids), ttl), lambda p: p.pin(list(ids), ttl))

    def unpin(self, ids: Sequence[int]) -> None:
        """Unpin blocks."""
        self.both(lambda p: p.unpin(list(ids)), lambda p: p.unpin(list(ids)))

    def quota(self, tenant: str, quota: int | None) -> None:
        """Set a tenant's quota."""
        self.both(lambda p: p.set_tenant_quota(tenant, quota), lambda p: p.set_tenant_quota(tenant, quota))

    def policy_to(self, policy: Policy) -> None:
        """Switch both pools' policy."""
        self.both(lambda p: p.set_policy(policy), lambda p: p.set_policy(policy))

    def evict(self, ids: Sequence[int]) -> None:
        """Explicit eviction of blocks' keys."""
        self.both(lambda p: p.evict_blocks(list(ids)), lambda p: p.evict_blocks(list(ids)))

    def reset(self) -> None:
        """Reset the prefix cache (refused while a block is held)."""
        self.both(lambda p: p.reset_prefix_cache(), lambda p: p.reset_prefix_cache())

    def advance(self, seconds: float, settle: bool = True) -> None:
        """Move the clock; both settle on their next call (at once with
        ``settle``, through a no-op unpin)."""
        self.clock.now += seconds
        if settle:
            self.unpin([])

    def keyed(self) -> list[int]:
        """Block ids carrying a key (the reference's view; the twins agree)."""
        return [block.block_id for block in self.ref.blocks[1:] if block.block_hash is not None]

    def free_keyed(self) -> list[int]:
        """Keyed blocks in the free queue."""
        return [block.block_id for block in self.ref.free_queue if block.block_hash is not None]
