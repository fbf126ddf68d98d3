"""The host tier of HiSparse groups, the obvious way (spec/host_tier.md).

Semantic model: two block pools (host and device), each a list of ref
counts, a free list (front = next to hand out) and a hash map; per request a
host row, a resident row (0 = host-only page), a hot region and page sets.
Every operation is a direct transcription of spec/host_tier.md; nothing is
fast on purpose. ``check_invariants`` checks HOST-1..HOST-14 by ID.
"""

from __future__ import annotations

import itertools
import pprint
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features import hisparse_rules as rules
from pagedkv.reference.features.hisparse_state import RequestState, TierPool
from pagedkv.reference.features.hisparse_steps import HostTierSteps
from pagedkv.spec.errors import (
    InvalidArgumentError,
    InvariantViolation,
    UnknownRequestError,
)
from pagedkv.spec.hisparse import (
    ACTIVE_TAIL_PAGES,
    HostAllocation,
    HostCacheEvent,
    HostTierSnapshot,
    PageTransfer,
    RequestResidency,
)
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.spec.hisparse import FenceHold, HostTierConfig, ResidencyUpdate, RowMirror

__all__ = ["HostTierManager", "release_to_back"]


def release_to_back(pool: BlockPool, ordered_blocks: Iterable[KVCacheBlock]) -> None:
    """Drop one reference of each block (held, none twice, no null block);
    those reaching zero go to the back of ``pool``'s free queue, hashed or
    not: a block its last holder keeps reading is reused last (D-HOST-18)."""
    blocks = list(ordered_blocks)
    if any(block.is_null or block.ref_cnt < 1 for block in blocks) or len({id(b) for b in blocks}) != len(blocks):
        raise InvariantViolation("POOL-3: release_to_back needs held blocks, none twice")
    for block in blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            pool.free_queue.append(block)


class HostTierManager(HostTierSteps):
    """The blocks of the HiSparse source, resident and hot groups, kept in a
    host pool and a device pool (spec/host_tier.md)."""

    def __init__(self, config: HostTierConfig) -> None:
        self.config = config
        self.spill_budget = config.spill_budget  # an engine may change it between steps
        # The two pools, and the blocks of them that others took: the device
        # blocks of other groups on a shared pool (D-HOST-18), the host
        # blocks of callers (D-HOST-23).
        self.host = TierPool(config.host_num_blocks)
        self.device = TierPool(config.device_num_blocks)
        self.shared: set[int] = set()
        self.host_taken: set[int] = set()
        # The requests, and the finished ones still waiting for their last
        # write-backs before their durable prefix is published (D-HOST-5).
        self.requests: dict[str, RequestState] = {}
        self.detached: list[RequestState] = []
        # What a released device block still serves until the pool hands it
        # out: the (request, page) pairs reading it, and the published host
        # hash it holds a copy of, which a hit may adopt (D-HOST-7).
        self.readers: dict[int, set[tuple[str, int]]] = {}
        self.copies: dict[BlockHash, int] = {}
        # Transfers: in flight (with their request), planned since the last
        # take_transfers, and the workers expected and done for each (D-HOST-12).
        self.transfers: dict[int, tuple[PageTransfer, RequestState]] = {}
        self.outbox: list[int] = []
        self.worker_counts: dict[int, tuple[int, int]] = {}
        self.next_transfer_id = 0
        # Blocks fenced for steps in flight; host cache events when recorded (D-HOST-26).
        self.fences: dict[int, FenceHold] = {}
        self.next_fence_id = 0
        self.events: list[HostCacheEvent] = []

    # -- queries -------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """The host blocks of the longest prefix of ``block_hashes`` the host
        cache holds (none with caching off)."""
        if not self.config.enable_caching:
            return ()
        prefix = itertools.takewhile(lambda block_hash: block_hash in self.host.cached, block_hashes)
        return tuple(self.host.cached[block_hash] for block_hash in prefix)

    def residency(self, request_id: str) -> RequestResidency:
        state = self._get(request_id)
        return RequestResidency(
            host_row=tuple(state.host_row), resident_row=tuple(state.resident_row), hot=tuple(state.hot),
            hot_required=state.hot_required, clean=frozenset(state.clean), pending=frozenset(state.pending),
            unpinned=frozenset(state.unpinned), published=state.published, importing=state.importing,
            synced=state.synced, stale=frozenset(state.stale))

    def can_read_from_host(self, request_id: str) -> bool:
        """Whether the request holds its hot region."""
        return len(self._get(request_id).hot) == self.config.hot_blocks_per_request

    def _get(self, request_id: str) -> RequestState:
        if request_id not in self.requests:
            raise UnknownRequestError(f"request_id {request_id!r} holds nothing in the host tier")
        return self.requests[request_id]

    def num_free_host_blocks(self) -> int:
        return len(self.host.free)

    def num_free_device_blocks(self) -> int:
        return len(self.device.free)

    # -- allocation ----------------------------------------------------------

    def _plan(self, request_id: str, num_tokens: int, hit: Sequence[int],
              block_hashes: Sequence[BlockHash] | None, num_external_tokens: int,
              num_local_tokens: int | None) -> tuple[RequestState | None, rules.AllocationCounts]:
        """The request's state (None when new) and the checked counts of the
        allocation; raises on bad arguments and changes nothing."""
        state = self.requests.get(request_id)
        held_hashes: Sequence[BlockHash]
        if state is None:
            held_pages, held_hashes, has_hot, hot_required = 0, (), False, False
        else:
            held_pages, held_hashes = len(state.host_row), state.block_hashes
            has_hot, hot_required = bool(state.hot), state.hot_required
        counts = rules.plan_allocation(self.config, request_id, num_tokens, hit, block_hashes, num_external_tokens,
                                 held_pages=held_pages, held_hashes=held_hashes, has_hot=has_hot,
                                 hot_required=hot_required, host_hash_of=self.host.hash_of,
                                 host_ref=self.host.ref, num_local_tokens=num_local_tokens)
        return state, counts

    def blocks_needed(self, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                      block_hashes: Sequence[BlockHash] | None = None,
                      num_external_tokens: int = 0,
                      num_local_tokens: int | None = None) -> tuple[int, int]:
        """How many free host and device blocks ``allocate`` would take with
        the same arguments, as ``(host, device)``; it succeeds exactly when
        both are free. Changes nothing."""
        counts = self._plan(request_id, num_tokens, hit, block_hashes, num_external_tokens, num_local_tokens)[1]
        host = counts.host_new + counts.free_hits
        device = counts.device_new + counts.hot_n
        return host, device

    def full_sequence_blocks(self, request_id: str, full_sequence_tokens: int) -> tuple[int, int]:
        """The ``(host, device)`` blocks the request still lacks to hold all
        ``full_sequence_tokens`` tokens, for an engine that admits a request
        only if its whole sequence fits. Each page takes a host block; device
        blocks are counted only within the admission window, since older pages
        move to host (D-HOST-11). A request the tier does not know holds
        nothing. Changes nothing."""
        state = self.requests.get(request_id)
        held_pages = 0 if state is None else len(state.host_row)
        hot_missing = state is not None and state.hot_required and not state.hot
        return rules.full_sequence_need(self.config, full_sequence_tokens, held_pages=held_pages,
                                  hot_missing=hot_missing)

    def allocate(self, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                 block_hashes: Sequence[BlockHash] | None = None,
                 num_external_tokens: int = 0,
                 num_local_tokens: int | None = None) -> HostAllocation | None:
        """Grow the request to ``num_tokens`` tokens (spec/host_tier.md,
        allocate). None when either pool lacks the blocks: the request is
        deferred and nothing changed."""
        state, counts = self._plan(request_id, num_tokens, hit, block_hashes, num_external_tokens,
                                   num_local_tokens)
        if counts.host_new + counts.free_hits > len(self.host.free):
            return None
        if counts.device_new + counts.hot_n > len(self.device.free):
            return None
        if state is None:
            state = RequestState(request_id)
            self.requests[request_id] = state
        state.block_hashes = counts.hashes
        # The hit's host pages are shared; only its computed pages are clean
        # now, the rest are filled by the import.
        for block in hit:
            self.host.hold(block)
        state.host_row.extend(hit)
        state.clean.update(range(counts.clean_hits))
        if hit:
            state.published = counts.clean_hits
        if hit or counts.imported:
            state.hot_required = True
            state.importing = counts.imported
        fresh_host = self._take_host(counts.host_new)
        state.host_row.extend(fresh_host)
        device_blocks = self._take_device(counts.device_new + counts.hot_n)
        resident, hot = device_blocks[:counts.device_new], device_blocks[counts.device_new:]
        state.resident_row.extend([0] * counts.host_only)
        state.resident_row.extend(resident)
        if counts.hot_n:
            state.hot = hot
        self._read_surviving_copies(state, counts.clean_hits)
        return HostAllocation(tuple(hit) + tuple(fresh_host), tuple(resident), tuple(hot))

    def _read_surviving_copies(self, state: RequestState, num_clean_hits: int) -> None:
        """A clean hit page whose device copy survives reads that copy
        (D-HOST-7). Looked for only once the new blocks are taken: admission
        did not count on the copies, and taking blocks may reuse them."""
        for page in range(num_clean_hits):
            block_hash = self.host.hash_of[state.host_row[page]]
            if block_hash in self.copies:
                copy = self.copies[block_hash]
                self.device.hold(copy)
                state.resident_row[page] = copy

    def finish_import(self, request_id: str, failed: bool = False) -> PageTransfer | None:
        """The external load into the request's host pages is over (D-HOST-9).

        If it failed, the request is freed: the engine admits it again and
        recomputes. If it worked, the sealed pages it wrote are clean and
        published, and the last page it wrote, which the engine replays into,
        is restored from host into its device block; that restore is returned.
        """
        if not self._get(request_id).importing:
            raise InvalidArgumentError(f"request {request_id!r} has no import in flight")
        if failed:
            self.free(request_id)
            return None
        state = self.requests[request_id]
        # The sealed pages it wrote are clean; the page the engine replays
        # into is restored from host into the device block its row holds.
        num_clean, replay_page = rules.import_pages(state.importing, self.config.block_size)
        state.importing = 0
        state.clean.update(range(num_clean))
        restore = self._restore_into_row(request_id, state, replay_page)
        self._publish(state)
        return restore

    def _restore_into_row(self, request_id: str, state: RequestState, page: int) -> PageTransfer:
        """A restore of ``page`` into its row's own device block, which the
        transfer holds once more until it lands."""
        self.device.hold(state.resident_row[page])
        return self._new_transfer(request_id, state, page, state.resident_row[page], "restore")

    def _take_host(self, n: int) -> list[int]:
        """``n`` free host blocks; a hashed one among them is evicted, and a
        device copy of its page with it (no hit can find the page any more)."""
        blocks = self.host.take(n)
        evicted = tuple(self.host.evicted)
        for block_hash in evicted:
            self._drop_copy(block_hash)
        if evicted and self.config.record_events:
            self.events.append(HostCacheEvent("removed", evicted))
        return blocks

    def _drop_copy(self, block_hash: BlockHash) -> None:
        self.copies.pop(block_hash, None)

    def _take_device(self, n: int) -> list[int]:
        """``n`` free device blocks; whatever they still served is lost."""
        blocks = self.device.take(n)
        self.device_blocks_taken(blocks)
        return blocks

    def device_blocks_taken(self, blocks: Sequence[int]) -> None:
        """The device pool handed out these blocks, to the tier or (on a
        shared pool) to another group: a copy they held is gone, and a page
        still reading one of them becomes host-only."""
        for block in blocks:
            self._forget_copies_in(block)
            for request_id, page in sorted(self.readers.pop(block, set())):
                self._lose_device_page(self.requests[request_id], page)

    def _lose_device_page(self, state: RequestState, page: int) -> None:
        """A released page's block was reused: the page is host-only now, the
        worker must hear of it, and the request needs its hot region again."""
        state.resident_row[page] = 0
        state.unpinned.discard(page)
        if page < state.synced:
            state.stale.add(page)
        state.hot_required = True

    def _forget_copies_in(self, block: int) -> None:
        """``block`` holds no copy of a published page any more."""
        for block_hash, copy in list(self.copies.items()):
            if copy == block:
                del self.copies[block_hash]

    def _record_copy(self, state: RequestState, page: int) -> None:
        """The page's device block becomes the copy of its published host
        block, unless it has none, or a restore still fills it (no hit may
        read a half-written copy)."""
        block, host_block = state.resident_row[page], state.host_row[page]
        if block == 0 or page in state.pending or host_block not in self.host.hash_of:
            return
        self._forget_copies_in(block)
        self.copies[self.host.hash_of[host_block]] = block

    def require_hot(self, request_id: str) -> None:
        """Ask for the request's hot region at its next allocation."""
        self._get(request_id).hot_required = True

    # -- write-back, restore, residency ---------------------------------------

    def _new_transfer(self, request_id: str, state: RequestState, page: int, device_block: int,
                      kind: Literal["writeback", "restore"]) -> PageTransfer:
        """Plan one transfer of ``page``; it holds the page's host block until it lands."""
        transfer_id = self.next_transfer_id
        self.next_transfer_id = transfer_id + 1
        host_block = state.host_row[page]
        transfer = PageTransfer(transfer_id, request_id, page, host_block, device_block, kind)
        self.transfers[transfer_id] = (transfer, state)
        state.pending[page] = transfer_id
        self.outbox.append(transfer_id)
        self.host.hold(host_block)
        return transfer

    def _dirty_on_device(self, state: RequestState, page: int) -> bool:
        """Whether the page has a device block not yet written back (HOST-5)."""
        return state.resident_row[page] != 0 and page not in state.clean and page not in state.pending

    def plan_writebacks(self, request_id: str, num_computed_tokens: int,
                        budget: int | None = None) -> list[PageTransfer]:
        """Write back the request's sealed dirty pages, lowest page first, at
        most ``budget`` of them (all when None)."""
        state = self._get(request_id)
        pages = rules.writeback_window(self.config.block_size, num_computed_tokens, len(state.resident_row),
                                 state.importing)
        planned: list[PageTransfer] = []
        for page in pages:
            within_budget = budget is None or len(planned) < budget
            if not within_budget:
                break
            if self._dirty_on_device(state, page):
                device_block = state.resident_row[page]
                self.device.hold(device_block)
                planned.append(self._new_transfer(request_id, state, page, device_block, "writeback"))
        return planned

    def plan_restore(self, request_id: str, page: int) -> PageTransfer | None:
        """Restore the clean host-only ``page`` into a fresh device block; None
        when the device pool has no free block."""
        state = self._get(request_id)
        restorable = (0 <= page < len(state.resident_row) and state.resident_row[page] == 0
                      and page not in state.pending and page in state.clean)
        if not restorable:
            raise InvalidArgumentError(
                f"page {page!r} of {request_id!r} is not a clean host-only page")
        if len(self.device.free) == 0:
            return None
        device_block = self._take_device(1)[0]
        return self._new_transfer(request_id, state, page, device_block, "restore")

    def complete(self, transfer_ids: Sequence[int]) -> None:
        """The worker ran these transfers (spec/host_tier.md, complete)."""
        rules.check_transfer_ids(transfer_ids, self.transfers)
        for transfer_id in transfer_ids:
            self.worker_counts.pop(transfer_id, None)
        to_publish: list[str] = []  # live requests, in the order their first transfer landed
        done_detached: list[RequestState] = []
        for transfer_id in transfer_ids:
            transfer, state = self.transfers.pop(transfer_id)
            self.host.release([transfer.host_block])
            if self.requests.get(transfer.request_id) is state:
                self._land(transfer, state)
                if transfer.request_id not in to_publish:
                    to_publish.append(transfer.request_id)
                continue
            # The request was freed: the transfer's device block goes back. A
            # detached request publishes once its last write-back landed.
            if state.held:
                del state.pending[transfer.page]
                if transfer.kind == "writeback":
                    state.clean.add(transfer.page)
                if not state.pending:
                    done_detached.append(state)
            self.device.release([transfer.device_block])
        for state in done_detached:
            self._finish_detached(state)
        for request_id in to_publish:
            self._publish(self.requests[request_id])

    def _land(self, transfer: PageTransfer, state: RequestState) -> None:
        """One transfer of a live request landed."""
        page, device_block = transfer.page, transfer.device_block
        del state.pending[page]
        if transfer.kind == "writeback":
            self.device.release([device_block])
            state.clean.add(page)
        elif state.resident_row[page] == device_block:
            self.device.release([device_block])  # restored into the block the row holds
        else:
            state.resident_row[page] = device_block  # the transfer's reference stays, now the row's
            if page < state.synced:
                state.stale.add(page)
        if transfer.kind == "restore" and page in state.clean:
            self._record_copy(state, page)
        if len(state.hot) == self.config.hot_blocks_per_request:
            # Released as soon as it is clean, in landing order: a prefix
            # written back in order is reused from its head.
            self._unpin_page(transfer.request_id, state, page)

    def _publish(self, state: RequestState) -> None:
        """Publish the request's clean pages from ``published`` on, in page
        order, up to the first page not clean (or its hashes' end)."""
        if not self.config.enable_caching:
            return
        limit = min(len(state.block_hashes), len(state.host_row))
        newly_stored: list[tuple[int, int]] = []
        while state.published < limit and state.published in state.clean:
            page = state.published
            block, block_hash = state.host_row[page], state.block_hashes[page]
            # publish keeps the first block cached under a hash: a store only if both are new.
            if block_hash not in self.host.cached and block not in self.host.hash_of:
                newly_stored.append((page, block))
            self.host.publish(block, block_hash)
            self._record_copy(state, page)
            state.published = page + 1
        if newly_stored and self.config.record_events:
            detached = self.requests.get(state.request_id) is not state
            self.events.extend(rules.stored_events(state.request_id, detached, state.block_hashes, newly_stored))

    def _unpin_clean(self, request_id: str, state: RequestState) -> None:
        for page in sorted(range(len(state.resident_row)), reverse=True):
            self._unpin_page(request_id, state, page)

    def _unpin_page(self, request_id: str, state: RequestState, page: int) -> None:
        """Release a clean pinned page outside the active tail; the request
        keeps reading it until the pool hands the block out."""
        block = state.resident_row[page]
        in_tail = page >= len(state.resident_row) - ACTIVE_TAIL_PAGES
        if in_tail or block == 0 or page not in state.clean or page in state.unpinned or page in state.pending:
            return
        self.device.unpin(block)
        self.readers.setdefault(block, set()).add((request_id, page))
        state.unpinned.add(page)

    def update_residency(self, request_id: str) -> None:
        """With its hot region the request reads from host, so its clean
        pages are released; without, it asks for the region once the device
        pool runs low."""
        state = self._get(request_id)
        if len(state.hot) == self.config.hot_blocks_per_request:
            self._unpin_clean(request_id, state)
        elif rules.wants_hot_region(self.config, len(self.device.free), len(state.resident_row)):
            state.hot_required = True

    # -- release -------------------------------------------------------------

    def take_residency_updates(self, request_ids: Sequence[str]) -> dict[str, ResidencyUpdate]:
        """What changed for the worker, per request that has news: its stale
        pages, then the pages the worker has not seen yet, with their device
        blocks (0: host-only). Every id is checked before anything changes."""
        states = [self._get(request_id) for request_id in request_ids]
        updates: dict[str, ResidencyUpdate] = {}
        for request_id, state in zip(request_ids, states):
            update = rules.residency_update(state.resident_row, state.synced, state.stale)
            state.stale, state.synced = set(), len(state.resident_row)
            if update is not None:
                updates[request_id] = update
        return updates

    def fully_resident(self, request_id: str) -> bool:
        """Whether the device holds every page of the request."""
        return 0 not in self._get(request_id).resident_row

    def row_mirrors(self, request_id: str, num_computed_tokens: int,
                    num_scheduled_tokens: int) -> list[RowMirror]:
        """The device and host places of the rows of tokens
        ``num_computed_tokens`` to ``num_computed_tokens + num_scheduled_tokens``,
        one mirror per span of a page. Pages past the row, and host-only pages
        (the device writes nothing there), get no mirror; the pages around
        them do. Changes nothing."""
        state = self._get(request_id)
        return rules.row_mirrors(self.config.block_size, state.resident_row, state.host_row,
                           num_computed_tokens, num_scheduled_tokens)

    def free(self, request_id: str, finished: bool = False) -> None:
        """Give back every block the request holds, the last page first in
        each row (spec/host_tier.md, free). ``finished`` (it ended, it was not
        preempted): a durable prefix still being written back is published
        once those write-backs land (D-HOST-5)."""
        state = self._get(request_id)
        self._detach_if_publishing(state, finished)
        to_release: list[int] = []
        for page in sorted(range(len(state.resident_row)), reverse=True):
            block = state.resident_row[page]
            if block == 0:
                pass  # host-only: nothing on the device
            elif page in state.unpinned:
                self._stop_reading(block, request_id, page)  # released already
            elif page not in state.pending and page in state.clean:
                self.device.unpin(block)  # a clean copy: readable until reused, so reused last
            else:
                to_release.append(block)
        self.device.release(to_release)
        self.device.release(list(reversed(state.hot)))
        self.host.release(list(reversed(state.host_row)))
        del self.requests[request_id]
        if state.held:
            state.resident_row = [0 for _ in state.resident_row]  # its device pages went with it
            self.detached.append(state)

    def _stop_reading(self, block: int, request_id: str, page: int) -> None:
        readers = self.readers[block]
        readers.discard((request_id, page))
        if len(readers) == 0:
            del self.readers[block]

    def _detach_if_publishing(self, state: RequestState, finished: bool) -> None:
        """A finished request whose write-backs are in flight keeps its
        publishable host blocks referenced, so no eviction takes them before
        they are published."""
        if not (finished and self.config.enable_caching):
            return
        publishable = min(len(state.block_hashes), len(state.host_row))
        if state.published >= publishable:
            return
        kinds = [self.transfers[transfer_id][0].kind for transfer_id in state.pending.values()]
        if "writeback" in kinds:
            state.held = state.host_row[:publishable]
            for block in state.held:
                self.host.hold(block)

    def _finish_detached(self, state: RequestState) -> None:
        """A detached request's last transfer landed: publish, then let go."""
        self._publish(state)
        held, state.held = state.held, []
        self.host.release(held[::-1])
        self.detached.remove(state)

    def reset_host_cache(self) -> bool:
        """Forget every host hash (and so every copy); refused, returning
        False, while any host block is held."""
        if any(count != 0 for count in self.host.ref):
            return False
        self.host.cached.clear()
        self.host.hash_of.clear()
        self.copies.clear()
        return True

    # -- observation ----------------------------------------------------------

    def snapshot(self) -> HostTierSnapshot:
        in_flight = sorted((transfer for transfer, _ in self.transfers.values()),
                           key=lambda transfer: transfer.transfer_id)
        return HostTierSnapshot(
            host_free=tuple(self.host.free),
            host_cached=tuple(sorted(self.host.cached.items())),
            device_free=tuple(self.device.free),
            requests=tuple((request_id, self.residency(request_id)) for request_id in sorted(self.requests)),
            in_flight=tuple(in_flight),
            copies=tuple(sorted(self.copies.items())),
            detached=tuple(tuple(state.held) for state in self.detached),
            outbox=tuple(self.outbox),
            worker_counts=tuple((transfer_id, expected, done)
                                for transfer_id, (expected, done) in sorted(self.worker_counts.items())),
            fences=tuple(self.fences[fence_id] for fence_id in sorted(self.fences)),
            shared=tuple(sorted(self.shared)),
            host_taken=tuple(sorted(self.host_taken)))

    def check_invariants(self) -> None:
        """HOST-1..HOST-14, by ID (raises InvariantViolation with a state dump)."""
        from pagedkv.reference.features.hisparse_invariants import check_host_tier

        check_host_tier(self)

    def _fail(self, invariant: str, message: str) -> InvariantViolation:
        return InvariantViolation(
            f"{invariant}: {message}\nstate:\n{pprint.pformat(self.snapshot(), width=120)}")
