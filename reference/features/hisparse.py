"""The host tier of HiSparse groups, the obvious way (spec/host_tier.md).

Semantic model: two block pools (host and device), each a list of ref
counts, a free list (front = next to hand out) and a hash map; per request a
host row, a resident row (0 = host-only page), a hot region and page sets.
Every operation is a direct transcription of spec/host_tier.md; nothing is
fast on purpose. ``check_invariants`` checks HOST-1..HOST-14 by ID.
"""

from __future__ import annotations

import pprint
from collections.abc import Iterable, Sequence
from typing import Literal

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features.hisparse_rules import (
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
from pagedkv.reference.features.hisparse_state import RequestState, TierPool
from pagedkv.reference.features.hisparse_steps import HostTierSteps
from pagedkv.spec.errors import (
    InvalidArgumentError,
    InvariantViolation,
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
    """Blocks of the HiSparse source, resident and hot groups in two pools."""

    def __init__(self, config: HostTierConfig) -> None:
        self.config = config
        self.host = TierPool(config.host_num_blocks)
        self.device = TierPool(config.device_num_blocks)
        self.requests: dict[str, RequestState] = {}
        # Released device block -> the (request, page) pairs still reading it.
        self.readers: dict[int, set[tuple[str, int]]] = {}
        # Published host hash -> a device block holding the same page, readable
        # until the pool hands the block out (D-HOST-7).
        self.copies: dict[BlockHash, int] = {}
        self.transfers: dict[int, tuple[PageTransfer, RequestState]] = {}
        self.next_transfer_id = 0
        # Finished requests whose last write-backs are in flight: their durable
        # prefix is published when those land (D-HOST-5).
        self.detached: list[RequestState] = []
        self.outbox: list[int] = []  # transfers planned since the last take_transfers
        self.spill_budget = config.spill_budget  # an engine may retune it between steps
        # In-flight transfer -> (workers expected, workers done) (D-HOST-12).
        self.worker_counts: dict[int, tuple[int, int]] = {}
        self.fences: dict[int, FenceHold] = {}  # blocks kept for in-flight steps
        self.next_fence_id = 0
        self.shared: set[int] = set()  # device blocks other groups took (D-HOST-18)
        self.host_taken: set[int] = set()  # host blocks callers took (D-HOST-23)
        self.events: list[HostCacheEvent] = []  # host cache changes, when recorded (D-HOST-26)

    # -- queries -------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """The host blocks of the longest cached prefix of ``block_hashes``."""
        hits: list[int] = []
        if self.config.enable_caching:
            for block_hash in block_hashes:
                if block_hash not in self.host.cached:
                    break
                hits.append(self.host.cached[block_hash])
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
        """Whether the request holds its hot region."""
        return len(self._get(request_id).hot) == self.config.hot_blocks_per_request

    def _get(self, request_id: str) -> RequestState:
        if request_id not in self.requests:
            raise UnknownRequestError(f"request_id {request_id!r} holds nothing in the host tier")
        return self.requests[request_id]

    # -- allocation ----------------------------------------------------------

    def _plan(self, request_id: str, num_tokens: int, hit: Sequence[int],
              block_hashes: Sequence[BlockHash] | None, num_external_tokens: int,
              num_local_tokens: int | None) -> tuple[RequestState | None, AllocationCounts]:
        """Validate an allocation and count what it needs (changes nothing)."""
        req = self.requests.get(request_id)
        return req, plan_allocation(
            self.config, request_id, num_tokens, hit, block_hashes, num_external_tokens,
            held_pages=len(req.host_row) if req is not None else 0,
            held_hashes=req.block_hashes if req is not None else (),
            has_hot=req is not None and bool(req.hot),
            hot_required=req is not None and req.hot_required,
            host_hash_of=self.host.hash_of, host_ref=self.host.ref,
            num_local_tokens=num_local_tokens)

    def blocks_needed(self, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                      block_hashes: Sequence[BlockHash] | None = None,
                      num_external_tokens: int = 0,
                      num_local_tokens: int | None = None) -> tuple[int, int]:
        """Read-only: the (host, device) free blocks ``allocate`` with these
        arguments would take; it succeeds iff both are available."""
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
        return full_sequence_need(
            self.config, full_sequence_tokens, held_pages=len(req.host_row) if req else 0,
            hot_missing=req is not None and req.hot_required and not req.hot)

    def allocate(self, request_id: str, num_tokens: int, hit: Sequence[int] = (),
                 block_hashes: Sequence[BlockHash] | None = None,
                 num_external_tokens: int = 0,
                 num_local_tokens: int | None = None) -> HostAllocation | None:
        """Grow the request to ``num_tokens`` tokens (spec/host_tier.md, allocate)."""
        req, plan = self._plan(request_id, num_tokens, hit, block_hashes, num_external_tokens,
                               num_local_tokens)
        hashes, imported, host_only = plan.hashes, plan.imported, plan.host_only
        host_new, hot_n, device_new = plan.host_new, plan.hot_n, plan.device_new
        if host_new > len(self.host.free) - plan.free_hits:
            return None  # host exhaustion defers the request (nothing changed)
        if device_new + hot_n > len(self.device.free):
            return None
        if req is None:
            req = self.requests[request_id] = RequestState(request_id)
        req.block_hashes = hashes
        for b in hit:
            self.host.hold(b)
            req.host_row.append(b)
        # Only the computed hit pages are clean; the rest are the import's.
        req.clean.update(range(plan.clean_hits))
        if hit:
            req.published = plan.clean_hits
        if hit or imported:
            req.hot_required = True
            req.importing = imported
        new_host = self._take_host(host_new)
        req.host_row.extend(new_host)
        taken = self._take_device(device_new + hot_n)
        req.resident_row.extend([0] * host_only + taken[:device_new])
        if hot_n:
            req.hot = taken[device_new:]
        # Clean hit pages adopt surviving device copies, after the new blocks
        # were taken (admission did not count on them).
        for page in range(plan.clean_hits):
            copy = self.copies.get(self.host.hash_of[req.host_row[page]])
            if copy is not None:
                self.device.hold(copy)
                req.resident_row[page] = copy
        return HostAllocation(tuple(hit) + tuple(new_host), tuple(taken[:device_new]),
                              tuple(taken[device_new:]))

    def finish_import(self, request_id: str, failed: bool = False) -> PageTransfer | None:
        """The external load into the request's host pages ended.

        Success: its sealed pages become clean (and are published), and the
        last imported page, which the engine replays into, gets a restore
        from host into its device block (returned). Failure: the request is
        freed; the engine admits it again and recomputes (D-HOST-9).
        """
        req = self._get(request_id)
        if not req.importing:
            raise InvalidArgumentError(f"request {request_id!r} has no import in flight")
        if failed:
            self.free(request_id)
            return None
        imported, req.importing = req.importing, 0
        num_clean, tail = import_pages(imported, self.config.block_size)
        req.clean.update(range(num_clean))
        self.device.hold(req.resident_row[tail])
        transfer = self._new_transfer(request_id, req, tail, req.resident_row[tail], "restore")
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
        self.copies.pop(block_hash, None)

    def _take_device(self, n: int) -> list[int]:
        """``n`` free device blocks; each one's copy and readers are lost."""
        blocks = self.device.take(n)
        self.device_blocks_taken(blocks)
        return blocks

    def device_blocks_taken(self, blocks: Sequence[int]) -> None:
        """The device pool handed these blocks out (to the tier or, when the
        pool is shared, to another group): their copies and readers are lost."""
        for b in blocks:
            for block_hash in [h for h, c in self.copies.items() if c == b]:
                del self.copies[block_hash]
            for request_id, page in sorted(self.readers.pop(b, set())):
                req = self.requests[request_id]
                req.resident_row[page] = 0
                req.unpinned.discard(page)
                if page < req.synced:
                    req.stale.add(page)
                req.hot_required = True

    def _record_copy(self, req: RequestState, page: int) -> None:
        b, host_block = req.resident_row[page], req.host_row[page]
        # A page a restore is still filling must not become a hit's copy.
        if b != 0 and host_block in self.host.hash_of and page not in req.pending:
            for block_hash in [h for h, c in self.copies.items() if c == b]:
                del self.copies[block_hash]
            self.copies[self.host.hash_of[host_block]] = b

    def require_hot(self, request_id: str) -> None:
        """Ask for the request's hot region at its next allocation."""
        self._get(request_id).hot_required = True

    # -- write-back, restore, residency ---------------------------------------

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
        """Write-back transfers of the sealed dirty pages, lowest first."""
        req = self._get(request_id)
        planned: list[PageTransfer] = []
        for page in writeback_window(self.config.block_size, num_computed_tokens,
                                     len(req.resident_row), req.importing):
            if budget is not None and len(planned) >= budget:
                break
            b = req.resident_row[page]
            if b == 0 or page in req.clean or page in req.pending:
                continue
            self.device.hold(b)
            planned.append(self._new_transfer(request_id, req, page, b, "writeback"))
        return planned

    def plan_restore(self, request_id: str, page: int) -> PageTransfer | None:
        """A restore of host-only ``page`` into a fresh device block, or None
        when the device pool has no free block."""
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
        """The worker ran these transfers (spec/host_tier.md, complete)."""
        check_transfer_ids(transfer_ids, self.transfers)
        for t in transfer_ids:
            self.worker_counts.pop(t, None)
        touched: list[str] = []
        finished_detached: list[RequestState] = []
        for t in transfer_ids:
            transfer, req = self.transfers.pop(t)
            live = self.requests.get(transfer.request_id) is req
            self.host.release([transfer.host_block])
            if live:
                del req.pending[transfer.page]
                if transfer.request_id not in touched:
                    touched.append(transfer.request_id)
            elif req.held:
                del req.pending[transfer.page]
                if transfer.kind == "writeback":
                    req.clean.add(transfer.page)
                if not req.pending:
                    finished_detached.append(req)
            if transfer.kind == "writeback":
                self.device.release([transfer.device_block])
                if live:
                    req.clean.add(transfer.page)
            elif live and req.resident_row[transfer.page] != transfer.device_block:
                req.resident_row[transfer.page] = transfer.device_block  # the ref moves to the row
                if transfer.page < req.synced:
                    req.stale.add(transfer.page)
            else:
                self.device.release([transfer.device_block])
            if live and transfer.kind == "restore" and transfer.page in req.clean:
                self._record_copy(req, transfer.page)
            if live and len(req.hot) == self.config.hot_blocks_per_request:
                # A page is released as soon as it is clean, in completion
                # order, so a prefix written back in order is reused head first.
                self._unpin_page(transfer.request_id, req, transfer.page)
        for req in finished_detached:
            self._finish_detached(req)
        for request_id in touched:
            self._publish(self.requests[request_id])

    def _publish(self, req: RequestState) -> None:
        if not self.config.enable_caching:
            return
        stored: list[tuple[int, int]] = []
        while (req.published < min(len(req.block_hashes), len(req.host_row))
               and req.published in req.clean):
            b, block_hash = req.host_row[req.published], req.block_hashes[req.published]
            if block_hash not in self.host.cached and b not in self.host.hash_of:
                stored.append((req.published, b))
            self.host.publish(b, block_hash)
            self._record_copy(req, req.published)
            req.published += 1
        if stored and self.config.record_events:
            self.events.extend(stored_events(req.request_id, self.requests.get(
                req.request_id) is not req, req.block_hashes, stored))

    def _unpin_clean(self, request_id: str, req: RequestState) -> None:
        for page in reversed(range(len(req.resident_row))):
            self._unpin_page(request_id, req, page)

    def _unpin_page(self, request_id: str, req: RequestState, page: int) -> None:
        """Release a clean pinned page outside the tail; the request keeps reading it."""
        b = req.resident_row[page]
        if page < len(req.resident_row) - ACTIVE_TAIL_PAGES and b != 0 and page in req.clean and (
                page not in req.unpinned and page not in req.pending):
            self.device.unpin(b)
            self.readers.setdefault(b, set()).add((request_id, page))
            req.unpinned.add(page)

    def update_residency(self, request_id: str) -> None:
        """Release clean pages when the request can read from host, else ask
        for a hot region when the device pool runs low."""
        req = self._get(request_id)
        if len(req.hot) == self.config.hot_blocks_per_request:
            self._unpin_clean(request_id, req)
        elif wants_hot_region(self.config, len(self.device.free), len(req.resident_row)):
            req.hot_required = True

    # -- release -------------------------------------------------------------

    def take_residency_updates(self, request_ids: Sequence[str]) -> dict[str, ResidencyUpdate]:
        """For each request with news, its stale pages then its pages the
        worker has never seen, with their device blocks (0: host-only)."""
        for request_id in request_ids:
            self._get(request_id)
        updates: dict[str, ResidencyUpdate] = {}
        for request_id in request_ids:
            req = self.requests[request_id]
            update = residency_update(req.resident_row, req.synced, req.stale)
            if update is not None:
                updates[request_id] = update
            req.stale = set()
            req.synced = len(req.resident_row)
        return updates

    def fully_resident(self, request_id: str) -> bool:
        """Whether every page of the request can be read from the device."""
        return all(b != 0 for b in self._get(request_id).resident_row)

    def row_mirrors(self, request_id: str, num_computed_tokens: int,
                    num_scheduled_tokens: int) -> list[RowMirror]:
        """Where the rows of tokens ``[num_computed_tokens, +num_scheduled_tokens)``
        go on the device and in the host pool, one mirror per page span; a
        host-only page (nothing written on the device) or a page beyond the
        row is skipped, its neighbours are not. Read-only."""
        req = self._get(request_id)
        return row_mirrors(self.config.block_size, req.resident_row, req.host_row,
                           num_computed_tokens, num_scheduled_tokens)

    def free(self, request_id: str, finished: bool = False) -> None:
        """Release every block the request holds, each list tail first.
        ``finished``: the request ended (it was not preempted), so its durable
        prefix is published once its in-flight write-backs land (D-HOST-5)."""
        req = self._get(request_id)
        self._detach_if_publishing(req, finished)
        dirty: list[int] = []
        for page in reversed(range(len(req.resident_row))):
            b = req.resident_row[page]
            if b == 0:
                continue
            if page in req.unpinned:
                self.readers[b].discard((request_id, page))
                if not self.readers[b]:
                    del self.readers[b]
            elif page in req.clean and page not in req.pending:
                self.device.unpin(b)  # a copy: readable until reused, so reused last
            else:
                dirty.append(b)
        self.device.release(dirty)
        self.device.release(req.hot[::-1])
        self.host.release(req.host_row[::-1])
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
            self.host.release([b])
        req.held = []
        self.detached.remove(req)

    def reset_host_cache(self) -> bool:
        """Drop every host hash; refused (False) while a host block is held."""
        if any(self.host.ref):
            return False
        self.host.cached.clear()
        self.host.hash_of.clear()
        self.copies.clear()
        return True

    # -- observation ----------------------------------------------------------

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

    def check_invariants(self) -> None:
        """HOST-1..HOST-14, by ID (raises InvariantViolation with a state dump)."""
        from pagedkv.reference.features.hisparse_invariants import check_host_tier

        check_host_tier(self)

    def _fail(self, invariant: str, message: str) -> InvariantViolation:
        return InvariantViolation(
            f"{invariant}: {message}\nstate:\n{pprint.pformat(self.snapshot(), width=120)}")
