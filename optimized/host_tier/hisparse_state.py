"""State records of the optimized host tier (spec/host_tier.md): a tier's
block pool over an ordered dict, one request's rows and page sets."""

from __future__ import annotations

from collections import OrderedDict

from pagedkv.spec.types import BlockHash

__all__ = ["TierPool", "RequestState"]


class TierPool:
    """Ref counts and an ordered free queue (``OrderedDict`` keys, front first):
    block 0 never in it, a block free exactly at ref count 0 (HOST-1).

    An ``OrderedDict`` rather than a plain dict: taking from the front of a
    plain dict leaves deleted slots that every later ``next(iter(...))`` must
    skip until the next resize, so a run of takes costs O(n^2); the linked
    list of an ``OrderedDict`` pops its front in O(1).
    """

    __slots__ = ("ref", "free", "hash_of", "cached", "evicted")

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.hash_of: dict[int, BlockHash] = {}
        self.cached: dict[BlockHash, int] = {}
        self.evicted: list[BlockHash] = []  # hashes the last ``take`` evicted

    def take(self, n: int) -> list[int]:
        """O(n): the first ``n`` free blocks, referenced, hashes evicted."""
        free, ref, hash_of = self.free, self.ref, self.hash_of  # hot path: locals
        blocks: list[int] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            b, _ = free.popitem(last=False)
            ref[b] = 1
            if b in hash_of:
                evicted.append(hash_of.pop(b))
                del self.cached[evicted[-1]]
            blocks.append(b)
        self.evicted = evicted
        return blocks

    def hold(self, b: int) -> None:
        """O(1)."""
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """O(1)."""
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None

    def unpin(self, b: int) -> None:
        """Release a block its holder keeps reading: to the back of the queue
        (the last to be reused). This pool queues every release there."""
        self.release(b)

    def release_batch(self, blocks: list[int]) -> None:
        """Release blocks in order (a shared pool queues them as one batch)."""
        for b in blocks:
            self.release(b)


class RequestState:
    __slots__ = ("request_id", "host_row", "resident_row", "hot", "hot_required", "clean", "pending",
                 "unpinned", "pinned_clean", "published", "block_hashes", "importing",
                 "synced", "stale", "held")

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self.host_row: list[int] = []
        self.resident_row: list[int] = []
        self.hot: list[int] = []
        self.hot_required = False
        self.clean: set[int] = set()
        self.pending: dict[int, int] = {}
        self.unpinned: set[int] = set()
        self.pinned_clean: set[int] = set()  # clean pages holding their device block
        self.published = 0
        self.block_hashes: list[BlockHash] = []
        self.importing = 0  # tokens an external load is still writing into host pages
        self.synced = 0  # the worker knows the residency of pages below this...
        self.stale: set[int] = set()  # ...except these, changed since
        self.held: list[int] = []  # host blocks kept for a finished request's late publication
