"""The host tier's per-step and release operations (spec/host_tier.md), the
reference's ``HostTierManager`` (``pagedkv.reference.features.hisparse``)
split in two files to stay readable:

- a step: ``advance``, ``take_transfers``, ``report_transfers`` (D-HOST-12/13);
- release while a step is in flight: ``pop_for_free`` / ``release_fence`` (D-HOST-16);
- the host cache: ``evict_host_blocks`` (D-HOST-17), ``take_host_events`` (D-HOST-26);
- blocks lent outside any request: ``take_shared`` / ``free_shared``
  (D-HOST-18), ``take_host`` / ``free_host`` and ``capacity_needed`` (D-HOST-23).

Written against the reference's own state (:class:`TierPool`,
:class:`RequestState`), apart from ``pagedkv.optimized.host_tier``'s mixin:
the lockstep machine compares the two. Blocks are released one at a time,
in the order the spec gives, so the free queues' order reads off the code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from pagedkv.reference.features import hisparse_rules as rules
from pagedkv.reference.features.hisparse_state import RequestState, TierPool
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hisparse import FenceHold, HostCacheEvent, HostTierConfig, PageTransfer
from pagedkv.spec.types import BlockHash

__all__ = ["HostTierSteps"]


class _HostTier(Protocol):
    """What these operations read and call of the reference's ``HostTierManager``
    (the class itself imports this module, so it is named by its shape here)."""

    # Its state, in the order the operations below read it.
    config: HostTierConfig
    spill_budget: int
    outbox: list[int]
    transfers: dict[int, tuple[PageTransfer, RequestState]]
    worker_counts: dict[int, tuple[int, int]]
    next_fence_id: int
    host: TierPool
    device: TierPool
    fences: dict[int, FenceHold]
    events: list[HostCacheEvent]
    shared: set[int]
    host_taken: set[int]
    requests: dict[str, RequestState]

    # In the order the operations below call them.
    def _get(self, request_id: str) -> RequestState: ...
    def plan_writebacks(self, request_id: str, num_computed_tokens: int,
                        budget: int | None = None) -> list[PageTransfer]: ...
    def update_residency(self, request_id: str) -> None: ...
    def complete(self, transfer_ids: Sequence[int]) -> None: ...
    def free(self, request_id: str, finished: bool = False) -> None: ...
    def _drop_copy(self, block_hash: BlockHash) -> None: ...
    def _take_device(self, n: int) -> list[int]: ...
    def _take_host(self, n: int) -> list[int]: ...


class HostTierSteps:
    """The operations of :class:`HostTierManager` listed in the module docstring."""

    def advance(self: _HostTier, request_id: str, num_tokens: int) -> list[PageTransfer]:
        """A step has brought the request to ``num_tokens`` computed tokens
        (spec/host_tier.md, advance): plan write-backs of its sealed pages,
        the reprefillable tokens left out and no more than the spill budget
        the outbox leaves, then update its residency."""
        self._get(request_id)  # refuses an unknown request first
        room_in_outbox = self.spill_budget - len(self.outbox)
        planned = self.plan_writebacks(request_id, rules.writeback_tokens(self.config, num_tokens),
                                       room_in_outbox if room_in_outbox > 0 else 0)
        self.update_residency(request_id)
        return planned

    def take_transfers(self: _HostTier) -> list[PageTransfer]:
        """Every transfer planned since the last call that is still in flight,
        in the order planned; the outbox is emptied."""
        in_flight = [self.transfers[transfer_id][0] for transfer_id in self.outbox if transfer_id in self.transfers]
        self.outbox.clear()
        return in_flight

    def report_transfers(self: _HostTier, enqueued: Mapping[int, int],
                         completed: Mapping[int, int]) -> list[int]:
        """Workers' counts (D-HOST-12): a transfer completes when as many
        workers reported it done as first enqueued it. Returns the completed
        ids; a report for an id not in flight is ignored."""
        tallies, finished = rules.tally_worker_counts(self.worker_counts, self.transfers, enqueued, completed)
        self.complete(finished)
        self.worker_counts = tallies
        return finished

    def pop_for_free(self: _HostTier, request_id: str, finished: bool = False) -> FenceHold:
        """``free`` the request, but first take one more reference on what a
        step still in flight may write (D-HOST-16): its host row, the device
        blocks of pages not yet clean, and its hot region. ``release_fence``
        gives them back."""
        req = self._get(request_id)
        hold = rules.fence_hold(self.next_fence_id, req.host_row, req.resident_row, req.clean, req.pending, req.hot)
        for block in hold.host_blocks:
            self.host.hold(block)
        for block in (*hold.resident_blocks, *hold.hot_blocks):
            self.device.hold(block)
        self.fences[hold.fence_id] = hold
        self.next_fence_id = hold.fence_id + 1
        self.free(request_id, finished)
        return hold

    def release_fence(self: _HostTier, fence_id: int) -> None:
        """The step a ``pop_for_free`` waited for has ended: give back its
        references, device then host, each list from its last block to its
        first. An unknown id: InvalidArgumentError, nothing changes."""
        if type(fence_id) is not int or fence_id not in self.fences:
            raise InvalidArgumentError(f"fence_id {fence_id!r} names no outstanding fence")
        hold = self.fences.pop(fence_id)
        device_order = [*reversed(hold.resident_blocks), *reversed(hold.hot_blocks)]
        for block in device_order:
            self.device.release([block])
        for block in reversed(hold.host_blocks):
            self.host.release([block])

    def evict_host_blocks(self: _HostTier, block_ids: Iterable[int]) -> list[BlockHash]:
        """Each named host block that is cached (held or free) loses its hash,
        and the device copy of that page goes too (D-HOST-17). Returns the
        hashes dropped, in the order named. An id outside the host pool:
        InvalidArgumentError, nothing changes."""
        named = rules.check_host_block_ids(block_ids, self.config.host_num_blocks)
        dropped: list[BlockHash] = []
        for block in named:
            if block not in self.host.hash_of:
                continue  # not cached: nothing to drop
            block_hash = self.host.hash_of.pop(block)
            self.host.cached.pop(block_hash)
            self._drop_copy(block_hash)
            dropped.append(block_hash)
        if self.config.record_events and dropped:
            self.events.append(HostCacheEvent("removed", tuple(dropped)))
        return dropped

    def take_host_events(self: _HostTier) -> list[HostCacheEvent]:
        """The host cache's changes since the last call, oldest first; always
        empty unless ``HostTierConfig.record_events`` (D-HOST-26)."""
        recorded = self.events.copy()
        self.events.clear()
        return recorded

    def take_shared(self: _HostTier, num_blocks: int) -> tuple[int, ...] | None:
        """Lend ``num_blocks`` device blocks to another device group on the
        same pool (the indexer), from the front of the free queue; a block an
        unpinned page or a copy still reads is lost to it, as when the tier
        allocates for itself (D-HOST-18). ``None`` when fewer are free (nothing changes).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.
        """
        wanted = rules.check_block_count(num_blocks)
        if len(self.device.free) < wanted:
            return None
        lent = self._take_device(wanted)
        for block in lent:
            self.shared.add(block)
        return tuple(lent)

    def free_shared(self: _HostTier, block_ids: Sequence[int]) -> None:
        """The other device group gives back blocks ``take_shared`` lent it, one
        by one in the order given. A block it does not hold, or one named
        twice: InvalidArgumentError, nothing changes."""
        returned = rules.check_held_blocks(block_ids, self.shared, "another group")
        for block in returned:
            self.shared.remove(block)
            self.device.release([block])

    def take_host(self: _HostTier, num_blocks: int) -> tuple[int, ...] | None:
        """Lend ``num_blocks`` host blocks to a caller outside any request
        (vLLM's host pool ``get_new_blocks``), from the front of the host free
        queue; a cached one loses its hash and its device copy, as when the
        tier allocates for itself (D-HOST-23). ``None`` when fewer are free
        (nothing changes).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.
        """
        wanted = rules.check_block_count(num_blocks)
        if len(self.host.free) < wanted:
            return None
        lent = self._take_host(wanted)
        for block in lent:
            self.host_taken.add(block)
        return tuple(lent)

    def free_host(self: _HostTier, block_ids: Sequence[int]) -> None:
        """A caller gives back host blocks ``take_host`` lent it, one by one
        in the order given, each to the back of the host free queue. A block
        it does not hold, or one named twice: InvalidArgumentError, nothing changes."""
        returned = rules.check_held_blocks(block_ids, self.host_taken, "a caller")
        for block in returned:
            self.host_taken.remove(block)
            self.host.release([block])

    def capacity_needed(self: _HostTier, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                        num_external_tokens: int = 0,
                        num_local_tokens: int | None = None) -> tuple[int, int]:
        """Read-only (D-HOST-23): the (host, device) free blocks an allocation
        of this shape would take. The hit is taken as given (it may name
        blocks the cache does not hold), and computed tokens ending inside a
        hit block count one more host block, for its copy. Refuses as
        ``count_allocation`` does; the hit's cache entries are not checked."""
        req = self.requests.get(request_id)
        if req is None:
            held_pages, has_hot, hot_required = 0, False, False
        else:
            held_pages, has_hot, hot_required = len(req.host_row), len(req.hot) > 0, req.hot_required
        counts = rules.count_allocation(self.config, request_id, num_tokens, hit, num_external_tokens,
                                  held_pages=held_pages, has_hot=has_hot, hot_required=hot_required,
                                  host_ref=self.host.ref, num_local_tokens=num_local_tokens)
        host_blocks = counts.host_new + counts.free_hits + counts.cow
        device_blocks = counts.device_new + counts.hot_n
        return host_blocks, device_blocks
