"""The per-step and release operations of the host tier (spec/host_tier.md),
of ``pagedkv.optimized.host_tier.hisparse``:
``advance``, ``take_transfers``, ``report_transfers`` (D-HOST-12/13),
``pop_for_free`` / ``release_fence`` (D-HOST-16), ``evict_host_blocks``
(D-HOST-17), ``take_shared`` / ``free_shared`` (D-HOST-18), ``take_host`` /
``free_host`` and ``capacity_needed`` (D-HOST-23), ``take_host_events`` (D-HOST-26).

A mixin of the ``HostTierManager`` class. Each implementation keeps its own
copy (no rule lives in ``pagedkv.spec``), so a mistake on one side is seen by
the lockstep machine.
What it reads and calls is named by ``_Tier``; a pool is anything with
``hold``, ``release_batch``, a sized free queue, ref counts and hash maps.
The scenarios of tests/test_hisparse*.py pin its behaviour on both tiers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence, Sized
from typing import Any, Protocol

from pagedkv.optimized.host_tier.hisparse_rules import (
    check_block_count,
    check_held_blocks,
    check_host_block_ids,
    count_allocation,
    fence_hold,
    tally_worker_counts,
    writeback_tokens,
)
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hisparse import FenceHold, HostCacheEvent, HostTierConfig, PageTransfer
from pagedkv.spec.types import BlockHash

__all__ = ["HostTierSteps"]


class _Pool(Protocol):
    @property
    def free(self) -> Sized: ...
    @property
    def ref(self) -> Sequence[int]: ...
    @property
    def hash_of(self) -> MutableMapping[int, BlockHash]: ...
    @property
    def cached(self) -> MutableMapping[BlockHash, int]: ...
    def hold(self, b: int) -> None: ...
    def release_batch(self, blocks: list[int]) -> None: ...


class _Request(Protocol):
    host_row: list[int]
    resident_row: list[int]
    hot: list[int]
    hot_required: bool
    clean: set[int]
    pending: dict[int, int]


class _Tier(Protocol):
    config: HostTierConfig
    outbox: list[int]
    spill_budget: int
    worker_counts: dict[int, tuple[int, int]]
    fences: dict[int, FenceHold]
    next_fence_id: int
    shared: set[int]
    host_taken: set[int]
    events: list[HostCacheEvent]

    @property
    def host(self) -> _Pool: ...
    @property
    def device(self) -> _Pool: ...
    @property
    def requests(self) -> Mapping[str, _Request]: ...
    @property
    def transfers(self) -> Mapping[int, tuple[PageTransfer, Any]]: ...
    def _get(self, request_id: str) -> _Request: ...
    def _take_host(self, n: int) -> list[int]: ...
    def _drop_copy(self, block_hash: BlockHash) -> None: ...
    def _take_device(self, n: int) -> list[int]: ...
    def plan_writebacks(self, request_id: str, num_computed_tokens: int,
                        budget: int | None = None) -> list[PageTransfer]: ...
    def update_residency(self, request_id: str) -> None: ...
    def complete(self, transfer_ids: Sequence[int]) -> None: ...
    def free(self, request_id: str, finished: bool = False) -> None: ...


class HostTierSteps:
    def advance(self: _Tier, request_id: str, num_tokens: int) -> list[PageTransfer]:
        """A step brings the request to ``num_tokens`` computed tokens: write
        back its sealed pages within the spill budget, reprefillable tokens
        left out, then update its residency (spec/host_tier.md, advance)."""
        self._get(request_id)
        computed = writeback_tokens(self.config, num_tokens)
        budget = max(self.spill_budget - len(self.outbox), 0)
        planned = self.plan_writebacks(request_id, computed, budget)
        self.update_residency(request_id)
        return planned

    def take_transfers(self: _Tier) -> list[PageTransfer]:
        """The transfers planned since the last call and still in flight, in
        plan order; the outbox empties."""
        taken = [self.transfers[t][0] for t in self.outbox if t in self.transfers]
        self.outbox.clear()
        return taken

    def report_transfers(self: _Tier, enqueued: Mapping[int, int],
                         completed: Mapping[int, int]) -> list[int]:
        """Per-worker counts: a transfer completes once as many workers
        reported it done as first enqueued it (D-HOST-12). Returns the ids
        completed; ids not in flight are ignored."""
        counts, finished = tally_worker_counts(self.worker_counts, self.transfers, enqueued,
                                               completed)
        self.complete(finished)
        self.worker_counts = counts
        return finished

    def pop_for_free(self: _Tier, request_id: str, finished: bool = False) -> FenceHold:
        """``free``, keeping referenced what a step still in flight may write:
        the host row, the device blocks of pages that are not clean and the
        hot region (D-HOST-16). ``release_fence`` drops them later."""
        req = self._get(request_id)
        hold = fence_hold(self.next_fence_id, req.host_row, req.resident_row, req.clean,
                          req.pending, req.hot)
        for b in hold.host_blocks:
            self.host.hold(b)
        for b in hold.resident_blocks + hold.hot_blocks:
            self.device.hold(b)
        self.next_fence_id += 1
        self.fences[hold.fence_id] = hold
        self.free(request_id, finished)
        return hold

    def release_fence(self: _Tier, fence_id: int) -> None:
        """The step a ``pop_for_free`` waited for has ended: drop its holds,
        each list tail first. An unknown id: InvalidArgumentError, nothing changes."""
        hold = self.fences.pop(fence_id, None) if type(fence_id) is int else None
        if hold is None:
            raise InvalidArgumentError(f"fence_id {fence_id!r} names no outstanding fence")
        for blocks in (hold.resident_blocks, hold.hot_blocks):
            for b in reversed(blocks):
                self.device.release_batch([b])
        for b in reversed(hold.host_blocks):
            self.host.release_batch([b])

    def evict_host_blocks(self: _Tier, block_ids: Iterable[int]) -> list[BlockHash]:
        """Drop the host cache entry of each named block that has one (held
        or free); its device copy goes too. Returns the hashes dropped, in
        order. A block id outside the host pool: InvalidArgumentError, nothing changes."""
        dropped: list[BlockHash] = []
        for b in check_host_block_ids(block_ids, self.config.host_num_blocks):
            block_hash = self.host.hash_of.pop(b, None)
            if block_hash is None:
                continue
            del self.host.cached[block_hash]
            self._drop_copy(block_hash)
            dropped.append(block_hash)
        if dropped and self.config.record_events:
            self.events.append(HostCacheEvent("removed", tuple(dropped)))
        return dropped

    def take_host_events(self: _Tier) -> list[HostCacheEvent]:
        """The host cache's changes since the last call, in order (empty unless
        ``HostTierConfig.record_events``, D-HOST-26)."""
        events = list(self.events)
        self.events.clear()
        return events

    def take_shared(self: _Tier, num_blocks: int) -> tuple[int, ...] | None:
        """``num_blocks`` device blocks for another device group sharing the
        pool (the indexer), from the front of the free queue; a block an
        unpinned page or a copy still reads is lost to it, as for the tier's
        own allocations (D-HOST-18). ``None`` when fewer are free (nothing changes).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.
        """
        if check_block_count(num_blocks) > len(self.device.free):
            return None
        blocks = self._take_device(num_blocks)
        self.shared.update(blocks)
        return tuple(blocks)

    def free_shared(self: _Tier, block_ids: Sequence[int]) -> None:
        """Another device group releases blocks ``take_shared`` gave it, in
        the given order. A block it does not hold, or one named twice:
        InvalidArgumentError, nothing changes."""
        for b in check_held_blocks(block_ids, self.shared, "another group"):
            self.shared.discard(b)
            self.device.release_batch([b])

    def take_host(self: _Tier, num_blocks: int) -> tuple[int, ...] | None:
        """``num_blocks`` host blocks for a caller outside any request (vLLM's
        host pool ``get_new_blocks``), from the front of the host free queue;
        a cached one loses its hash and its device copy, as for the tier's own
        allocations (D-HOST-23). ``None`` when fewer are free (nothing changes).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.
        """
        if check_block_count(num_blocks) > len(self.host.free):
            return None
        blocks = self._take_host(num_blocks)
        self.host_taken.update(blocks)
        return tuple(blocks)

    def free_host(self: _Tier, block_ids: Sequence[int]) -> None:
        """A caller gives back host blocks ``take_host`` gave it, in the given
        order (each to the back of the host free queue). A block it does not
        hold, or one named twice: InvalidArgumentError, nothing changes."""
        for b in check_held_blocks(block_ids, self.host_taken, "a caller"):
            self.host_taken.discard(b)
            self.host.release_batch([b])

    def capacity_needed(self: _Tier, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                        num_external_tokens: int = 0,
                        num_local_tokens: int | None = None) -> tuple[int, int]:
        """Read-only: the (host, device) free blocks an allocation of this
        shape would take, the hit taken as given (it may name blocks the host
        cache does not hold) and computed tokens ending inside a hit block
        counting one host block for its copy (D-HOST-23). Same refusals as
        ``count_allocation``; the hit's cache entries are not checked."""
        req = self.requests.get(request_id)
        counts = count_allocation(
            self.config, request_id, num_tokens, hit, num_external_tokens,
            held_pages=len(req.host_row) if req is not None else 0,
            has_hot=req is not None and bool(req.hot),
            hot_required=req is not None and req.hot_required, host_ref=self.host.ref,
            num_local_tokens=num_local_tokens)
        return counts.host_new + counts.free_hits + counts.cow, counts.device_new + counts.hot_n
