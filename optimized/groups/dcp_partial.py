"""Sub-block hits in full-attention groups whose block spans several hash
blocks -- what decode context parallelism's widened blocks need
(spec/mamba.md, "DCP and full-attention sub-block hits", FPART-1..5).

The coordinator swaps :class:`FullAttentionSubBlockManager` in for a
full-attention group larger than the hash block when sub-block hits are
switched on (no request is known then). The rules are the reference's
(``pagedkv.reference.features.dcp_partial``); here the hit search scans the cached
full blocks once, then probes only the first block past them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.mamba_partial import key_block
from pagedkv.optimized.groups.single_type import FullAttentionManager
from pagedkv.optimized.rules.dcp_rules import (
    prompt_tail_boundary,
    tail_boundaries,
)
from pagedkv.optimized.rules.eagle_rules import sub_block_eagle_limit
from pagedkv.optimized.rules.mamba_partial_rules import (
    state_keys_in_block,
)
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

__all__ = ["FullAttentionSubBlockManager"]


class FullAttentionSubBlockManager(FullAttentionManager):
    """Full attention hit at hash-block granularity (FPART-1..4): lookups
    read the request's hash-block hashes (``RawHashViews``), caching the
    group's own view."""

    __slots__ = ("hash_block_size", "partial_hits", "partial_hit", "copies", "extra_tail", "extra_holders")

    def _setup(self) -> None:
        """Sub-block state (``replacing`` sets the hash block size). Cost: O(1)."""
        self.hash_block_size = 1
        self.partial_hits = True
        # request -> (column, shared block) copied on its next allocation; the
        # queued (source, destination) copies, one retention each (MPART-3).
        self.partial_hit: dict[str, tuple[int, int]] = {}
        self.copies: list[tuple[int, int]] = []
        # Partial keys of blocks already carrying their full key (one key per
        # block in the pool): block -> (partial hash, that full hash), and
        # partial hash -> blocks, oldest first; valid while the block keeps
        # that full key (FPART-2, D-MAMBA-22).
        self.extra_tail: dict[int, tuple[BlockHash, BlockHash]] = {}
        self.extra_holders: dict[BlockHash, list[int]] = {}

    @classmethod
    def replacing(cls, manager: FullAttentionManager, hash_block_size: int) -> FullAttentionSubBlockManager:
        """A fresh sub-block manager for ``manager``'s group (which knows no
        request). Cost: O(1)."""
        assert not manager.req_to_blocks
        replacement = cls(manager.kv_cache_spec, block_pool=manager.block_pool, group_id=manager.group_id,
                          block_size=manager.block_size, enable_caching=manager.enable_caching,
                          alignment=hash_block_size, use_eagle=manager.use_eagle,
                          retention_interval=manager.retention_interval)
        replacement.hash_block_size = hash_block_size
        return replacement

    # ---------------------------------------------------------------- hits

    def _full_key(self, fine: Sequence[BlockHash], column: int) -> BlockHash:
        scale = self.block_size // self.hash_block_size
        return BlockHash(b"".join(fine[column * scale:(column + 1) * scale]))

    def _tail(self, fine: Sequence[BlockHash], length: int, max_length: int) -> int | None:
        """The block serving a hit's part inside its last block (FPART-1):
        that column's full-key block when the whole block lies within
        ``max_length`` and the hashes, else the first holder of the partial
        key of the largest boundary cached. Cost: O(hash blocks per block)."""
        size, hash_size = self.block_size, self.hash_block_size
        hashed = len(fine) * hash_size
        get = self.block_pool.cached_by_group[self.group_id].get
        column = length // size
        if (column + 1) * size <= min(max_length, hashed):
            found: int | None = get(self._full_key(fine, column))
            if found is not None:
                return found
        for boundary in tail_boundaries(length, max_length, hashed, hash_size, size):
            found = self._partial_lookup(fine[boundary // hash_size - 1])
            if found is not None:
                return found
        return None

    def _partial_lookup(self, partial: BlockHash) -> int | None:
        """The pool's first holder of a partial key, else the oldest block
        whose extra entry still holds. Cost: O(1) (O(stale entries) on a miss)."""
        pool = self.block_pool
        found: int | None = pool.cached_by_group[self.group_id].get(partial)
        if found is not None or not self.extra_holders:
            return found
        group_id, hashes, gids = self.group_id, pool._hash, pool._gid
        for block in self.extra_holders.get(partial, ()):
            entry = self.extra_tail[block]
            if gids[block] == group_id and hashes[block] == entry[1]:
                return block
        return None

    def extra_entry_serves(self, fine: Sequence[BlockHash], index: int, block: int) -> bool:
        """Whether ``block``, at ``index`` of a hit, still serves through its
        extra entry (the partial hash of a boundary inside it, the block
        still under the full key it had then). Cost: O(hash blocks per block)."""
        entry = self.extra_tail.get(block)
        pool = self.block_pool
        return (entry is not None and pool._gid[block] == self.group_id and pool._hash[block] == entry[1]
                and entry[0] in state_keys_in_block(fine, index, self.hash_block_size, self.block_size))

    def lookup_limit(self, max_length: int, peek: int, num_hashed_tokens: int) -> int:
        """One hash block past the cap for EAGLE (FPART-5), else the cap. Cost: O(1)."""
        if self.use_eagle:
            return sub_block_eagle_limit(max_length, num_hashed_tokens, self.hash_block_size)
        return max_length

    def longest_hit(self, view: Sequence[BlockHash], bound: int, max_length: int) -> int:
        """The cached full blocks from the start (within ``max_length`` and
        the hashes), then the best boundary inside the next block; with
        EAGLE one hash block less (FPART-5); clipped to ``bound`` (hits are
        downward closed, so the clip is a hit).
        Cost: O(blocks of the cached prefix + hash blocks per block)."""
        size, hash_size = self.block_size, self.hash_block_size
        limit = min(max_length, len(view) * hash_size)
        get = self.block_pool.cached_by_group[self.group_id].get
        full = 0
        while (full + 1) * size <= limit and get(self._full_key(view, full)) is not None:
            full += 1
        found = full * size
        for boundary in tail_boundaries(found + hash_size, max_length, len(view) * hash_size, hash_size, size):
            if self._partial_lookup(view[boundary // hash_size - 1]) is not None:
                found = boundary
                break
        if self.use_eagle and found:
            found -= hash_size  # given back to the drafter
        return min(found, bound)

    def hit_blocks(self, view: Sequence[BlockHash], length: int, max_length: int | None = None) -> list[int]:
        """The full blocks of the hit, then its tail block. Cost: O(L / b)."""
        table = self.block_pool.cached_by_group[self.group_id]
        blocks = [table[self._full_key(view, column)] for column in range(length // self.block_size)]
        if length % self.block_size:
            tail = self._tail(view, length, length if max_length is None else max_length)
            assert tail is not None
            blocks.append(tail)
        return blocks

    # ----------------------------------------------------------- allocation

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int],
                                   num_total_computed_tokens: int, num_main_tokens: int,
                                   num_external_computed_tokens: int = 0) -> int:
        """See the base class; a new request whose hit ends inside a block
        takes one more block, the copy's destination. Cost: as the base's."""
        demand = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, num_total_computed_tokens, num_main_tokens,
            num_external_computed_tokens)
        if (new_computed_blocks and request_id not in self.req_to_blocks
                and (num_total_computed_tokens - num_external_computed_tokens) % self.block_size):
            return demand + 1
        return demand

    def admit(self, request_id: str, new_computed_blocks: Sequence[int],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """See the base class; a hit ending inside a block records the block
        to copy, and only the whole blocks before it count as cached.
        Cost: as the base's."""
        super().admit(request_id, new_computed_blocks, num_local_computed_tokens,
                      num_external_computed_tokens)
        if new_computed_blocks and num_local_computed_tokens % self.block_size:
            # FPART-3: the tail to copy, the block held at its column (MPART-2).
            column = num_local_computed_tokens // self.block_size
            self.partial_hit[request_id] = (column, self.req_to_blocks[request_id][column])
            self.num_cached_blocks[request_id] = column

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[int]:
        """See the base class; first the copy of a shared tail block, which
        takes its place (the source keeps the hit's reference as its
        retention, the destination one more). Cost: O(new blocks)."""
        partial = self.partial_hit.pop(request_id, None) if self.partial_hit else None
        if partial is None:
            return super().allocate_new_blocks(request_id, num_tokens, num_main_tokens)
        column, source = partial
        blocks = self.req_to_blocks[request_id]
        copied: list[int] = []
        if blocks[column] == source:
            pool = self.block_pool
            destination = pool.get_new_blocks(1)[0]
            blocks[column] = destination
            pool._ref[destination] += 1
            self.copies.append((source, destination))
            copied.append(destination)
        return copied + super().allocate_new_blocks(request_id, num_tokens, num_main_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued copies, oldest first; emptied. Cost: O(1)."""
        copies, self.copies = self.copies, []
        return copies

    # ------------------------------------------------------ caching, freeing

    def cache_blocks(self, request: HashedRequest, view: Sequence[BlockHash] | None,
                     request_id: str, num_tokens: int) -> None:
        """See the base class; a published block now full trades its partial
        key for its full one first (FPART-4), then the prompt tail is
        published (FPART-2). Cost: O(blocks newly cached + 1)."""
        pool = self.block_pool
        blocks = self.req_to_blocks[request_id]
        keys = request.block_hashes if view is None else view
        gids, hashes = pool._gid, pool._hash
        for index in range(self.num_cached_blocks[request_id],
                           min(num_tokens // self.block_size, len(blocks), len(keys))):
            block = blocks[index]
            if gids[block] >= 0 and hashes[block] != keys[index]:
                pool._evict(block, announce=False)  # no event (D-MAMBA-18)
        super().cache_blocks(request, view, request_id, num_tokens)
        prompt = getattr(request, "num_prompt_tokens", None)
        if type(prompt) is not int:
            return
        hash_size = self.hash_block_size
        boundary = prompt_tail_boundary(prompt, len(request.block_hashes), hash_size, self.use_eagle)
        if boundary <= 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        column = boundary // self.block_size
        if column >= len(blocks) or not blocks[column]:
            return
        block, partial = blocks[column], request.block_hashes[boundary // hash_size - 1]
        if gids[block] < 0:
            key_block(pool, block, partial, self.group_id, boundary)
            return
        if gids[block] != self.group_id or column >= len(keys) or hashes[block] != keys[column]:
            return
        # Already keyed with its full key: the partial key is its extra entry (D-MAMBA-22).
        old = self.extra_tail.get(block)
        if old is not None and old[0] != partial:
            holders = self.extra_holders[old[0]]
            holders.remove(block)
            if not holders:
                del self.extra_holders[old[0]]
        self.extra_tail[block] = (partial, keys[column])
        holders = self.extra_holders.setdefault(partial, [])
        if block not in holders:
            holders.append(block)

    def release(self, request_id: str) -> None:
        """Forget a pending copy, then release. Cost: O(blocks held)."""
        if self.partial_hit:
            self.partial_hit.pop(request_id, None)
        super().release(request_id)
