"""State records of the reference host tier (spec/host_tier.md): a tier's
block pool, one request's rows and page sets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.spec.types import BlockHash

__all__ = ["TierPool", "RequestState"]


class TierPool:
    """Ref counts, a free list and a hash map; block 0 is the null block."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free = list(range(1, num_blocks))
        self.hash_of: dict[int, BlockHash] = {}
        self.cached: dict[BlockHash, int] = {}
        self.evicted: list[BlockHash] = []  # hashes the last ``take`` evicted

    def take(self, n: int) -> list[int]:
        """The first ``n`` free blocks, referenced; a hashed one is evicted."""
        blocks = self.free[:n]
        del self.free[:n]
        self.evicted = []
        for b in blocks:
            self.ref[b] += 1
            if b in self.hash_of:
                self.evicted.append(self.hash_of.pop(b))
                del self.cached[self.evicted[-1]]
        return blocks

    def hold(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)

    def release_batch(self, blocks: list[int]) -> None:
        """Release blocks in order (the name the shared step mixin calls)."""
        self.release(blocks)

    def unpin(self, b: int) -> None:
        """Release a block its holder keeps reading: to the back of the free
        queue (the last to be reused). This pool queues every release there."""
        self.release([b])

    def publish(self, b: int, block_hash: BlockHash) -> None:
        # The first block cached under a hash keeps it (spec/state.md).
        if block_hash not in self.cached and b not in self.hash_of:
            self.cached[block_hash] = b
            self.hash_of[b] = block_hash


@dataclass(eq=False)
class RequestState:
    request_id: str = ""
    host_row: list[int] = field(default_factory=list)
    resident_row: list[int] = field(default_factory=list)
    hot: list[int] = field(default_factory=list)
    hot_required: bool = False
    clean: set[int] = field(default_factory=set)
    pending: dict[int, int] = field(default_factory=dict)
    unpinned: set[int] = field(default_factory=set)
    published: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    importing: int = 0  # tokens an external load is still writing into host pages
    synced: int = 0  # the worker knows the residency of pages below this...
    stale: set[int] = field(default_factory=set)  # ...except these, changed since
    held: list[int] = field(default_factory=list)  # host blocks kept for a late publication
