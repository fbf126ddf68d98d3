"""The host tier of HiSparse groups with cheaper structures (spec/host_tier.md).

Same observable behaviour as ``pagedkv.reference.features.hisparse`` (the lockstep
test runs both), different structures:

- each pool's free queue is an ``OrderedDict``, so taking a hit block out of
  the middle of the queue, or a block off its front, is O(1), not a list scan;
- each request keeps the set of its clean *pinned* pages, so releasing clean
  pages costs O(pages released) rather than a walk over the whole row;
- allocation counts free hit blocks without copying anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pagedkv.optimized.host_tier.hisparse_rules import (
    AllocationCounts,
    check_transfer_ids,
    full_sequence_need,
    import_pages,
    plan_allocation,
    residency_update,
    row_mirrors,
    stored_events,
    wants_hot_region,
    writeback_window,
)
from pagedkv.optimized.host_tier.hisparse_state import RequestState, TierPool
from pagedkv.optimized.host_tier.hisparse_steps import HostTierSteps
from pagedkv.spec.errors import (
    InvalidArgumentError,
    UnknownRequestError,
)
from pagedkv.spec.hisparse import (
    ACTIVE_TAIL_PAGES,
    FenceHold,
    HostAllocation,
    HostCacheEvent,
    HostTierConfig,
    HostTierSnapshot,
    PageTransfer,
    RequestResidency,
    ResidencyUpdate,
    RowMirror,
)
from pagedkv.spec.types import BlockHash

__all__ = ["HostTierManager"]


class HostTierManager(HostTierSteps):
    """Blocks of the HiSparse source, resident and hot groups in two pools."""

    def __init__(self, config: HostTierConfig, device_pool: TierPool | None = None) -> None:
        self.config = config
        self._block_size = config.block_size
        self._hot_n = config.hot_blocks_per_request
        self.host = TierPool(config.host_num_blocks)
        # An engine may pass the device pool its other groups share (D-HOST-18).
        self.device = device_pool if device_pool is not None else TierPool(config.device_num_blocks)
        self.requests: dict[str, RequestState] = {}
        self.readers: dict[int, set[tuple[str, int]]] = {}
        self.copies: dict[BlockHash, int] = {}
        self._copy_of: dict[int, BlockHash] = {}  # the reverse of ``copies``
        self.transfers: dict[int, tuple[PageTransfer, RequestState]] = {}
        self.next_transfer_id = 0
        # Finished requests whose last write-backs are in flight: their durable
        # prefix is published when those land (D-HOST-5).
        self.detached: list[RequestState] = []
        self.outbox: list[int] = []  # transfers planned since the last take_transfers
        self.spill_budget = config.spill_budget  # an engine may retune it between steps
        # In-flight transfer -> (workers expected, workers done) (D-HOST-12);
        # only in-flight transfers, dropped once complete (HOST-13).
        self.worker_counts: dict[int, tuple[int, int]] = {}
        self.fences: dict[int, FenceHold] = {}  # blocks kept for in-flight steps
        self.next_fence_id = 0
        self.shared: set[int] = set()  # device blocks other groups took (D-HOST-18)
        self.host_taken: set[int] = set()  # host blocks callers took (D-HOST-23)
        self.events: list[HostCacheEvent] = []  # host cache changes, when recorded (D-HOST-26)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """O(hit length): host blocks of the longest cached prefix."""
        if not self.config.enable_caching:
            return ()
        cached = self.host.cached
        hits: list[int] = []
        for block_hash in block_hashes:
            b = cached.get(block_hash)
            if b is None:
                break
            hits.append(b)
        return tuple(hits)

    def num_free_host_blocks(self) -> int:
        return len(self.host.free)

    def num_free_device_blocks(self) -> int:
        return len(self.device.free)

    def residency(self, request_id: str) -> RequestResidency:
        req = self._get(request_id)
        return RequestResidency(
            tuple(req.host_row), tuple(req.resident_row), tuple(req.hot), req.hot_required,
            frozenset(req.clean), frozenset(req.pending), frozenset(req.unpinned), req.published,
            req.importing, req.synced, frozenset(req.stale))

    def can_read_from_host(self, request_id: str) -> bool:
        return len(self._get(request_id).hot) == self._hot_n

    def _get(self, request_id: str) -> RequestState:
        req = self.requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"request_id {request_id!r} holds nothing in the host tier")
        return req

    def _plan(self, request_id: str, num_tokens: int, hit: Sequence[int],
              block_hashes: Sequence[BlockHash] | None, num_external_tokens: int,
              num_local_tokens: int | None) -> tuple[RequestState | None, AllocationCounts]:
        """O(hit). Validate an allocation and count what it needs (changes nothing)."""
        req = self.requests.get(request_id)
        if req is None:
            return None, plan_allocation(
                self.config, request_id, num_tokens, hit, block_hashes, num_external_tokens,
                held_pages=0, held_hashes=(), has_hot=False, hot_required=False,
                host_hash_of=self.host.hash_of, host_ref=self.host.ref,
                num_local_tokens=num_local_tokens)
        return req, plan_allocation(
            self.config, request_id, num_tokens, hit, block_hashes, num_external_tokens,
            held_pages=len(req.host_row), held_hashes=req.block_hashes, has_hot=bool(req.hot),
            hot_required=req.hot_required, host_hash_of=self.host.hash_of, host_ref=self.host.ref,
            num_local_tokens=num_local_tokens)

    def blocks_needed(self, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                      block_hashes: Sequence[BlockHash] | None = None,
                      num_external_tokens: int = 0,
                      num_local_tokens: int | None = None) -> tuple[int, int]:
        """O(hit). Read-only: the (host, device) free blocks ``allocate`` with
        these arguments would take; it succeeds iff both are available."""
        _, plan = self._plan(request_id, num_tokens, hit, block_hashes, num_external_tokens,
                             num_local_tokens)
        return plan.host_new + plan.free_hits, plan.device_new + plan.hot_n

    def full_sequence_blocks(self, request_id: str, full_sequence_tokens: int) -> tuple[int, int]:
        """Read-only: the (host, device) blocks the request still needs to hold
        ``full_sequence_tokens`` tokens, for an engine that admits a request
        only when its whole sequence fits. Every page needs a host block, but
        resident pages count only up to the admission window: older pages move
        to host (D-HOST-11). An unknown request holds nothing."""
        req = self.requests.get(request_id)
        if req is None:
            return full_sequence_need(self.config, full_sequence_tokens, held_pages=0,
                                      hot_missing=False)
        return full_sequence_need(self.config, full_sequence_tokens, held_pages=len(req.host_row),
                                  hot_missing=req.hot_required and not req.hot)

    def allocate(self, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                 block_hashes: Sequence[BlockHash] | None = None,
                 num_external_tokens: int = 0,
                 num_local_tokens: int | None = None) -> HostAllocation | None:
        """O(new blocks + hit). Validate, count, then commit (nothing changes on None)."""
        req, plan = self._plan(request_id, num_tokens, hit, block_hashes, num_external_tokens,
                               num_local_tokens)
        hashes, imported, host_only = plan.hashes, plan.imported, plan.host_only
        host_new, hot_n, device_new = plan.host_new, plan.hot_n, plan.device_new
        host = self.host
        if host_new > len(host.free) - plan.free_hits:
            return None  # host exhaustion defers the request
        if device_new + hot_n > len(self.device.free):
            return None
        if req is None:
            req = self.requests[request_id] = RequestState(request_id)
        req.block_hashes = hashes
        if hit:  # a hit only for a request holding nothing: its pages start at 0
            for b in hit:
                host.hold(b)  # one host reference per row entry (HOST-2)
            req.host_row.extend(hit)
            req.clean.update(range(plan.clean_hits))
            req.published = plan.clean_hits
        if hit or imported:
            req.hot_required = True  # host-only pages need the hot region (HOST-8)
            req.importing = imported  # its pages: a clean prefix, then the import's (HOST-14)
        new_host = self._take_host(host_new)
        req.host_row.extend(new_host)  # every page has a host block (HOST-4)
        taken = self._take_device(device_new + hot_n)  # pinned pages hold references (HOST-3)
        resident = taken[:device_new]
        if host_only:
            req.resident_row.extend([0] * host_only)
        req.resident_row.extend(resident)
        if hot_n:
            req.hot = taken[device_new:]  # the whole hot region at once (HOST-7)
        if hit and self.copies:
            copies, hash_of, row = self.copies, host.hash_of, req.resident_row
            for page, host_block in enumerate(hit[:plan.clean_hits]):
                copy = copies.get(hash_of[host_block])
                if copy is not None:
                    self.device.hold(copy)
                    row[page] = copy
                    req.pinned_clean.add(page)
        return HostAllocation(tuple(hit) + tuple(new_host), tuple(resident),
                              tuple(taken[device_new:]))

    def finish_import(self, request_id: str, failed: bool = False) -> PageTransfer | None:
        """O(imported pages). Success: sealed imported pages clean, a restore
        of the last imported page; failure: the request is freed (D-HOST-9)."""
        req = self._get(request_id)
        if not req.importing:
            raise InvalidArgumentError(f"request {request_id!r} has no import in flight")
        if failed:
            self.free(request_id)
            return None
        imported, req.importing = req.importing, 0
        num_clean, tail = import_pages(imported, self._block_size)
        req.clean.update(range(num_clean))
        block = req.resident_row[tail]
        self.device.hold(block)
        transfer = self._new_transfer(request_id, req, tail, block, "restore")
        self._publish(req)
        return transfer

    def _take_host(self, n: int) -> list[int]:
        blocks = self.host.take(n)
        if self.host.evicted and self.config.record_events:
            self.events.append(HostCacheEvent("removed", tuple(self.host.evicted)))
        for block_hash in self.host.evicted:
            self._drop_copy(block_hash)  # a copy of a page no hit can find
        return blocks

    def _drop_copy(self, block_hash: BlockHash) -> None:
        copy = self.copies.pop(block_hash, None)
        if copy is not None:
            del self._copy_of[copy]

    def _take_device(self, n: int) -> list[int]:
        """O(n + pages lost): each taken block's copy and readers are lost."""
        blocks = self.device.take(n)
        self.device_blocks_taken(blocks)
        return blocks

    def device_blocks_taken(self, blocks: Sequence[int]) -> None:
        """The device pool handed these blocks out (to the tier or, when the
        pool is shared, to another group): their copies and readers are lost."""
        if not (self._copy_of or self.readers):
            return
        for b in blocks:
            block_hash = self._copy_of.pop(b, None)
            if block_hash is not None:
                del self.copies[block_hash]
            owners = self.readers.pop(b, None)
            if owners is None:
                continue
            for request_id, page in owners:
                req = self.requests[request_id]
                req.resident_row[page] = 0
                req.unpinned.discard(page)
                if page < req.synced:  # the worker's row is exact but for stale pages (HOST-11)
                    req.stale.add(page)
                req.hot_required = True

    def _record_copy(self, req: RequestState, page: int) -> None:
        # One device copy per published hash, one hash per copy block (HOST-12).
        b = req.resident_row[page]
        block_hash = self.host.hash_of.get(req.host_row[page])
        if b == 0 or block_hash is None or page in req.pending:
            return  # no device page, unpublished, or a restore is still filling it
        old = self.copies.get(block_hash)
        if old is not None:
            del self._copy_of[old]
        old_hash = self._copy_of.get(b)
        if old_hash is not None:
            del self.copies[old_hash]
        self.copies[block_hash] = b
        self._copy_of[b] = block_hash

    def require_hot(self, request_id: str) -> None:
        self._get(request_id).hot_required = True

    def _new_transfer(self, request_id: str, req: RequestState, page: int, device_block: int,
                      kind: Literal["writeback", "restore"]) -> PageTransfer:
        transfer = PageTransfer(self.next_transfer_id, request_id, page, req.host_row[page],
                                device_block, kind)
        self.next_transfer_id += 1
        self.transfers[transfer.transfer_id] = (transfer, req)
        req.pending[page] = transfer.transfer_id
        self.outbox.append(transfer.transfer_id)
        self.host.hold(transfer.host_block)
        return transfer

    def plan_writebacks(self, request_id: str, num_computed_tokens: int,
                        budget: int | None = None) -> list[PageTransfer]:
        """O(sealed pages)."""
        req = self._get(request_id)
        window = writeback_window(self._block_size, num_computed_tokens, len(req.resident_row),
                                  req.importing)
        planned: list[PageTransfer] = []
        # A write-back's page stays resident, pinned and dirty until it lands (HOST-5).
        row, clean, pending = req.resident_row, req.clean, req.pending
        for page in window:
            if budget is not None and len(planned) >= budget:
                break
            b = row[page]
            if b == 0 or page in clean or page in pending:
                continue
            self.device.hold(b)
            planned.append(self._new_transfer(request_id, req, page, b, "writeback"))
        return planned

    def plan_restore(self, request_id: str, page: int) -> PageTransfer | None:
        """O(1)."""
        req = self._get(request_id)
        if not (0 <= page < len(req.resident_row)) or req.resident_row[page] != 0 or (
                page in req.pending) or page not in req.clean:
            raise InvalidArgumentError(
                f"page {page!r} of {request_id!r} is not a clean host-only page")
        if not self.device.free:
            return None
        (b,) = self._take_device(1)
        return self._new_transfer(request_id, req, page, b, "restore")

    def complete(self, transfer_ids: Sequence[int]) -> None:
        """O(transfers + pages published + pages released)."""
        check_transfer_ids(transfer_ids, self.transfers)
        for t in transfer_ids:
            self.worker_counts.pop(t, None)
        touched: dict[str, RequestState] = {}
        finished_detached: list[RequestState] = []
        for t in transfer_ids:
            transfer, req = self.transfers.pop(t)
            live = self.requests.get(transfer.request_id) is req
            self.host.release(transfer.host_block)
            page = transfer.page
            if live:
                del req.pending[page]
                touched.setdefault(transfer.request_id, req)
            elif req.held:
                del req.pending[page]
                if transfer.kind == "writeback":
                    req.clean.add(page)
                if not req.pending:
                    finished_detached.append(req)
            if transfer.kind == "writeback":
                self.device.release(transfer.device_block)
                if live:
                    req.clean.add(page)
                    req.pinned_clean.add(page)
            elif live:
                if req.resident_row[page] == transfer.device_block:
                    self.device.release(transfer.device_block)  # an import's tail: row holds it
                else:
                    req.resident_row[page] = transfer.device_block
                    if page < req.synced:
                        req.stale.add(page)
                if page in req.clean:
                    req.pinned_clean.add(page)
                    self._record_copy(req, page)
            else:
                self.device.release(transfer.device_block)
            if live and len(req.hot) == self._hot_n and page in req.pinned_clean and (
                    page < len(req.resident_row) - ACTIVE_TAIL_PAGES):
                self._unpin(transfer.request_id, req, page)  # in completion order (D-HOST-19)
        for req in finished_detached:
            self._finish_detached(req)
        for req in touched.values():
            self._publish(req)

    def _publish(self, req: RequestState) -> None:
        if not self.config.enable_caching:
            return
        limit = min(len(req.block_hashes), len(req.host_row))
        cached, hash_of = self.host.cached, self.host.hash_of
        stored: list[tuple[int, int]] = []
        while req.published < limit and req.published in req.clean:  # a clean prefix only (HOST-9)
            b, block_hash = req.host_row[req.published], req.block_hashes[req.published]
            if block_hash not in cached and b not in hash_of:
                cached[block_hash] = b
                hash_of[b] = block_hash
                stored.append((req.published, b))
            self._record_copy(req, req.published)
            req.published += 1
        if stored and self.config.record_events:
            self.events.extend(stored_events(req.request_id, self.requests.get(
                req.request_id) is not req, req.block_hashes, stored))

    def _unpin_clean(self, request_id: str, req: RequestState) -> None:
        tail = len(req.resident_row) - ACTIVE_TAIL_PAGES  # the tail stays pinned (HOST-10)
        movable = [page for page in req.pinned_clean if page < tail]
        if not movable:
            return
        movable.sort(reverse=True)  # tail first: a context loses its tail before its head
        for page in movable:
            self._unpin(request_id, req, page)

    def _unpin(self, request_id: str, req: RequestState, page: int) -> None:
        b = req.resident_row[page]
        self.device.unpin(b)
        self.readers.setdefault(b, set()).add((request_id, page))  # HOST-6
        req.unpinned.add(page)
        req.pinned_clean.discard(page)

    def update_residency(self, request_id: str) -> None:
        req = self._get(request_id)
        if len(req.hot) == self._hot_n:
            self._unpin_clean(request_id, req)
        elif wants_hot_region(self.config, len(self.device.free), len(req.resident_row)):
            req.hot_required = True

    def take_residency_updates(self, request_ids: Sequence[str]) -> dict[str, ResidencyUpdate]:
        """O(pages sent). What the worker lacks for each request: its stale
        pages, then the pages appended since the last update."""
        requests = [(request_id, self._get(request_id)) for request_id in request_ids]
        updates: dict[str, ResidencyUpdate] = {}
        for request_id, req in requests:
            row = req.resident_row
            if not req.stale and req.synced >= len(row):
                continue  # the common case: nothing new, no list built
            update = residency_update(row, req.synced, req.stale)
            if update is not None:
                updates[request_id] = update
            req.stale.clear()
            req.synced = len(row)
        return updates

    def fully_resident(self, request_id: str) -> bool:
        """Whether every page of the request can be read from the device."""
        return 0 not in self._get(request_id).resident_row

    def row_mirrors(self, request_id: str, num_computed_tokens: int,
                    num_scheduled_tokens: int) -> list[RowMirror]:
        """O(pages spanned). Read-only: one mirror per resident page span."""
        req = self._get(request_id)
        return row_mirrors(self._block_size, req.resident_row, req.host_row,
                           num_computed_tokens, num_scheduled_tokens)

    def free(self, request_id: str, finished: bool = False) -> None:
        """O(pages + hot). ``finished``: the request ended (not preempted), so
        its durable prefix is published once its in-flight write-backs land."""
        req = self._get(request_id)
        self._detach_if_publishing(req, finished)
        row, unpinned, readers, device = req.resident_row, req.unpinned, self.readers, self.device
        dirty: list[int] = []
        for page in range(len(row) - 1, -1, -1):
            b = row[page]
            if b == 0:
                continue
            if page in unpinned:
                owners = readers[b]
                owners.discard((request_id, page))
                if not owners:
                    del readers[b]
            elif page in req.clean and page not in req.pending:
                device.unpin(b)  # a copy: readable until reused, so reused last
            else:
                dirty.append(b)
        device.release_batch(dirty)
        device.release_batch(req.hot[::-1])
        for b in reversed(req.host_row):
            self.host.release(b)
        del self.requests[request_id]
        if req.held:
            req.resident_row = [0] * len(req.resident_row)  # its device pages are gone
            self.detached.append(req)

    def _detach_if_publishing(self, req: RequestState, finished: bool) -> None:
        """Keep the publishable host blocks of a finished request with write-backs
        in flight referenced, so nothing evicts them before they are published."""
        limit = min(len(req.block_hashes), len(req.host_row))
        if finished and self.config.enable_caching and req.published < limit and any(
                self.transfers[t][0].kind == "writeback" for t in req.pending.values()):
            req.held = req.host_row[:limit]
            for b in req.held:
                self.host.hold(b)

    def _finish_detached(self, req: RequestState) -> None:
        """The last in-flight transfer of a detached request landed."""
        self._publish(req)
        for b in reversed(req.held):
            self.host.release(b)
        req.held = []
        self.detached.remove(req)

    def reset_host_cache(self) -> bool:
        if len(self.host.free) != len(self.host.ref) - 1:
            return False
        self.host.cached.clear()
        self.host.hash_of.clear()
        self.copies.clear()
        self._copy_of.clear()
        return True

    def snapshot(self) -> HostTierSnapshot:
        return HostTierSnapshot(
            tuple(self.host.free), tuple(sorted((h, b) for h, b in self.host.cached.items())),
            tuple(self.device.free),
            tuple((r, self.residency(r)) for r in sorted(self.requests)),
            tuple(t for t, _ in sorted(self.transfers.values(), key=lambda x: x[0].transfer_id)),
            tuple(sorted(self.copies.items())),
            tuple(tuple(req.held) for req in self.detached), tuple(self.outbox),
            tuple((t, e, d) for t, (e, d) in sorted(self.worker_counts.items())),
            tuple(self.fences[f] for f in sorted(self.fences)), tuple(sorted(self.shared)),
            tuple(sorted(self.host_taken)))
