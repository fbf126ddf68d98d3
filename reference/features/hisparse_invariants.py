"""HOST-1..HOST-14 of spec/host_tier.md, checked over the reference host tier."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedkv.spec.hisparse import ACTIVE_TAIL_PAGES

if TYPE_CHECKING:
    from pagedkv.reference.features.hisparse import HostTierManager
    from pagedkv.reference.features.hisparse_state import TierPool

__all__ = ["check_host_tier"]


def _check_pool(tier: HostTierManager, pool: TierPool, name: str, expected: Counter[int]) -> None:
    # HOST-1: the null block is inert; free <=> ref 0.
    if pool.ref[0] != 0 or 0 in pool.free or 0 in pool.hash_of:
        raise tier._fail("HOST-1", f"{name} null block is referenced, free-listed or cached")
    if len(set(pool.free)) != len(pool.free):
        raise tier._fail("HOST-1", f"{name} free list repeats a block")
    free = set(pool.free)
    for b in range(1, pool.num_blocks):
        if (b in free) != (pool.ref[b] == 0) or pool.ref[b] < 0:
            raise tier._fail("HOST-1", f"{name} block {b} has ref {pool.ref[b]}, free={b in free}")
    # HOST-2 / HOST-3: every reference has an owner.
    for b in range(1, pool.num_blocks):
        if pool.ref[b] != expected[b]:
            inv = "HOST-2" if name == "host" else "HOST-3"
            raise tier._fail(inv, f"{name} block {b} has ref {pool.ref[b]}, owners {expected[b]}")
    if {b: h for h, b in pool.cached.items()} != pool.hash_of:
        raise tier._fail("HOST-9", f"{name} cache map and block hashes disagree")


def check_host_tier(tier: HostTierManager) -> None:
    host_refs: Counter[int] = Counter()
    device_refs: Counter[int] = Counter()
    readers: dict[int, set[tuple[str, int]]] = {}
    hot_blocks: set[int] = set()
    dirty_blocks: set[int] = set()
    hot_n = tier.config.hot_blocks_per_request
    for held in tier.detached:
        host_refs.update(held.held)
    device_refs.update(tier.shared)  # D-HOST-18: other device groups' blocks
    host_refs.update(tier.host_taken)  # D-HOST-23: blocks callers took
    for hold in tier.fences.values():  # D-HOST-16: blocks kept for an in-flight step
        host_refs.update(hold.host_blocks)
        device_refs.update(hold.resident_blocks + hold.hot_blocks)
        dirty_blocks.update(hold.resident_blocks)
        hot_blocks.update(hold.hot_blocks)
    for transfer, _ in tier.transfers.values():
        host_refs[transfer.host_block] += 1
        device_refs[transfer.device_block] += 1
    for request_id, req in tier.requests.items():
        host_refs.update(req.host_row)
        device_refs.update(req.hot)
        hot_blocks.update(req.hot)
        dirty_blocks.update(b for p, b in enumerate(req.resident_row) if p not in req.clean)
        # HOST-4: every page has a host block.
        if len(req.host_row) != len(req.resident_row) or 0 in req.host_row:
            raise tier._fail("HOST-4", f"{request_id}: host row and resident row disagree")
        # HOST-7: the hot region is all or nothing.
        if len(req.hot) not in (0, hot_n):
            raise tier._fail("HOST-7", f"{request_id}: hot region of {len(req.hot)} blocks")
        for page, b in enumerate(req.resident_row):
            restoring = page in req.pending and tier.transfers[req.pending[page]][0].kind == "restore"
            # HOST-5: host-only pages are clean; pending pages have their state.
            importing = page < -(-req.importing // tier.config.block_size)
            if b == 0 and page not in req.clean and not importing:
                raise tier._fail("HOST-5", f"{request_id}: host-only page {page} is not clean")
            if page in req.pending and not restoring and b == 0:
                raise tier._fail("HOST-5", f"{request_id}: write-back page {page} is host-only")
            if restoring and b not in (0, tier.transfers[req.pending[page]][0].device_block):
                raise tier._fail("HOST-5", f"{request_id}: restore of page {page} to another block")
            if page in req.pending and not restoring and (page in req.clean or page in req.unpinned):
                raise tier._fail("HOST-5", f"{request_id}: write-back page {page} is not dirty")
            if b == 0:
                continue
            if page in req.unpinned:
                # HOST-6 / HOST-10: unpinned pages are clean, outside the tail.
                if page not in req.clean:
                    raise tier._fail("HOST-6", f"{request_id}: unpinned page {page} is dirty")
                if page >= len(req.resident_row) - ACTIVE_TAIL_PAGES:
                    raise tier._fail("HOST-10", f"{request_id}: tail page {page} is unpinned")
                readers.setdefault(b, set()).add((request_id, page))
            else:
                device_refs[b] += 1
        # HOST-14: an import's pages are a clean prefix (the computed hit), then
        # host-only pages, then its last page, which has a device block.
        import_end = -(-req.importing // tier.config.block_size)
        if import_end:
            computed = next((p for p in range(import_end) if p not in req.clean), import_end)
            late = range(computed, import_end)
            if computed == import_end or any(p in req.clean for p in late) or any(
                    req.resident_row[p] != 0 for p in late[:-1]) or (
                    req.resident_row[import_end - 1] == 0):
                raise tier._fail("HOST-14", f"{request_id}: import of {req.importing} tokens "
                                 f"over pages {req.resident_row[:import_end]}")
        # HOST-8: reading from host needs the hot region.
        if req.unpinned and not req.hot:
            raise tier._fail("HOST-8", f"{request_id}: unpinned pages without a hot region")
        if 0 in req.resident_row and not (req.hot or req.hot_required):
            raise tier._fail("HOST-8", f"{request_id}: host-only pages, no hot region asked for")
        # HOST-11: the worker's view covers pages that exist.
        if req.synced > len(req.resident_row) or any(p >= req.synced for p in req.stale):
            raise tier._fail("HOST-11", f"{request_id}: synced {req.synced}, stale {req.stale}")
        # HOST-9: only a clean prefix is published.
        if any(page not in req.clean for page in range(req.published)):
            raise tier._fail("HOST-9", f"{request_id}: published {req.published} pages, not all clean")
    if readers != tier.readers:
        raise tier._fail("HOST-6", f"readers {tier.readers} != unpinned pages {readers}")
    # HOST-12: a copy holds a published page and nothing else.
    for block_hash, b in tier.copies.items():
        if tier.host.cached.get(block_hash) is None or not 0 < b < tier.device.num_blocks:
            raise tier._fail("HOST-12", f"copy {b} of an unpublished hash")
        if b in hot_blocks or b in dirty_blocks or any(
                t.device_block == b for t, _ in tier.transfers.values()):
            raise tier._fail("HOST-12", f"copy block {b} is used for something else")
    if len(set(tier.copies.values())) != len(tier.copies):
        raise tier._fail("HOST-12", "one device block copies two pages")
    # HOST-13: worker counts name in-flight transfers, never a finished count.
    for t, (expected, done) in tier.worker_counts.items():
        if t not in tier.transfers or (expected and done >= expected):
            raise tier._fail("HOST-13", f"worker counts {t}: ({expected}, {done})")
    if len(set(tier.outbox)) != len(tier.outbox) or any(
            t >= tier.next_transfer_id for t in tier.outbox):
        raise tier._fail("HOST-13", f"outbox {tier.outbox} repeats or names an unplanned id")
    _check_pool(tier, tier.host, "host", host_refs)
    _check_pool(tier, tier.device, "device", device_refs)
