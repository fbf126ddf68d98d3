"""Sub-block hits in full-attention groups whose block spans several hash
blocks -- what decode context parallelism's widened blocks need
(spec/mamba.md, "DCP and full-attention sub-block hits", FPART-1..5).

The coordinator swaps this manager in for a full-attention group larger
than the hash block when sub-block hits are switched on (no request is
known then, so nothing is carried over). Brute force on purpose: every
lookup walks the keys it needs, one block at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features.dcp_rules import prompt_tail_boundary, tail_boundaries
from pagedkv.reference.features.mamba_partial import key_block
from pagedkv.reference.features.mamba_partial_rules import state_keys_in_block
from pagedkv.reference.single_type import FullAttentionManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.types import BlockHash, BlockHashWithGroupId, make_block_hash_with_group_id

__all__ = ["FullAttentionSubBlockManager"]


def _coarse(fine_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int) -> list[BlockHash]:
    """The request's hashes at ``block_size`` (each the concatenation of the
    hash blocks it spans, D-HASH-5)."""
    scale = block_size // hash_block_size
    return [BlockHash(b"".join(fine_hashes[index * scale:(index + 1) * scale]))
            for index in range(len(fine_hashes) // scale)]


class FullAttentionSubBlockManager(FullAttentionManager):
    """Full attention hit at hash-block granularity: a hit may end inside a
    block, which the request then copies before writing on (FPART-1..4).

    Lookups (``can_hit``, ``hit_blocks``) read the request's hash-block
    hashes; caching reads the group's own view, as for every group.
    """

    @classmethod
    def replacing(cls, manager: FullAttentionManager, hash_block_size: int) -> FullAttentionSubBlockManager:
        """A fresh sub-block manager for ``manager``'s group (which knows no request)."""
        assert not manager.req_to_blocks
        replacement = cls(manager.kv_cache_spec, block_pool=manager.block_pool, group_id=manager.group_id,
                          block_size=manager.block_size, enable_caching=manager.enable_caching,
                          alignment=manager.alignment, use_eagle=manager.use_eagle,
                          retention_interval=manager.retention_interval, admission_cap=manager.admission_cap)
        replacement.hash_block_size = hash_block_size
        return replacement

    def __init__(self, kv_cache_spec: KVCacheSpec, *, block_pool: BlockPool, group_id: int,
                 block_size: int, enable_caching: bool, alignment: int, use_eagle: bool,
                 retention_interval: int | None = None, admission_cap: int | None = None) -> None:
        super().__init__(kv_cache_spec, block_pool=block_pool, group_id=group_id, block_size=block_size,
                         enable_caching=enable_caching, alignment=alignment, use_eagle=use_eagle,
                         retention_interval=retention_interval, admission_cap=admission_cap)
        self.hash_block_size = 1  # set by ``replacing``
        self.partial_hits = True
        # request -> (column, shared block) the request copies on its next
        # allocation; the queued (source, destination) copies, each endpoint
        # holding one retention reference (MPART-3).
        self.partial_hit: dict[str, tuple[int, KVCacheBlock]] = {}
        self.copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # Partial keys of blocks that already carry their full key (the pool
        # keeps one key per block, CACHE-1): block id -> (partial hash, the
        # full key it had then), and partial hash -> its blocks, oldest
        # first. An entry serves while its block still carries that full key
        # (FPART-2, D-MAMBA-22); one per block, the latest.
        self.extra_tail: dict[int, tuple[BlockHash, BlockHashWithGroupId]] = {}
        self.extra_holders: dict[BlockHash, list[KVCacheBlock]] = {}

    # -- hits ---------------------------------------------------------------------

    def _tail(self, fine_hashes: Sequence[BlockHash], length: int, max_length: int) -> KVCacheBlock | None:
        """The block serving the part of a hit of ``length`` tokens inside its
        last block (FPART-1): the block cached under that column's full key
        when the whole block lies within ``max_length`` and the hashes, else
        the first holder of the partial key of the largest boundary found."""
        size, hash_size = self.block_size, self.hash_block_size
        hashed = len(fine_hashes) * hash_size
        column = length // size
        if (column + 1) * size <= min(max_length, hashed):
            found = self._lookup(_coarse(fine_hashes, hash_size, size)[column])
            if found is not None:
                return found
        for boundary in tail_boundaries(length, max_length, hashed, hash_size, size):
            found = self._partial_lookup(fine_hashes[boundary // hash_size - 1])
            if found is not None:
                return found
        return None

    def _partial_lookup(self, partial: BlockHash) -> KVCacheBlock | None:
        """The block a partial key names: the pool's first holder, else the
        oldest block whose extra entry still holds (FPART-2)."""
        found = self._lookup(partial)
        if found is not None:
            return found
        for block in self.extra_holders.get(partial, ()):
            entry = self.extra_tail.get(block.block_id)
            if entry is not None and entry[0] == partial and block.block_hash == entry[1]:
                return block
        return None

    def holds_hit(self, block_hashes: Sequence[BlockHash], view: Sequence[BlockHash], index: int,
                  block: KVCacheBlock) -> bool:
        # A block may carry the partial key of a boundary inside it (MPART-1),
        # or serve it through its extra entry while it keeps its full key (FPART-2).
        partials = state_keys_in_block(block_hashes, index, self.hash_block_size, self.block_size)
        if block.block_hash in {make_block_hash_with_group_id(key, self.group_id) for key in partials}:
            return True
        entry = self.extra_tail.get(block.block_id)
        if entry is not None and block.block_hash == entry[1] and entry[0] in partials:
            return True
        return super().holds_hit(block_hashes, view, index, block)

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        """FPART-1; with EAGLE (FPART-5) the hit one hash block longer must be
        served within ``max_length`` (then given back: the kept tail block
        still holds the shorter prefix, its KV being append-only)."""
        if self.use_eagle:
            longer = length + self.hash_block_size
            return longer <= max_length and self._can_hit_plain(block_hashes, longer, max_length)
        return self._can_hit_plain(block_hashes, length, max_length)

    def _can_hit_plain(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        coarse = _coarse(block_hashes, self.hash_block_size, self.block_size)
        full = length // self.block_size
        if full > len(coarse) or any(self._lookup(coarse[index]) is None for index in range(full)):
            return False
        return length % self.block_size == 0 or self._tail(block_hashes, length, max_length) is not None

    def hit_blocks(self, block_hashes: Sequence[BlockHash], length: int,
                   max_length: int | None = None) -> list[KVCacheBlock]:
        coarse = _coarse(block_hashes, self.hash_block_size, self.block_size)
        blocks = [self._lookup(coarse[index]) for index in range(length // self.block_size)]
        if length % self.block_size:
            blocks.append(self._tail(block_hashes, length, length if max_length is None else max_length))
        assert all(block is not None for block in blocks)
        return [block for block in blocks if block is not None]

    # -- allocation -----------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int,
                                   num_main_tokens: int, num_external_computed_tokens: int = 0) -> int:
        demand = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                    num_total_computed_tokens, num_main_tokens,
                                                    num_external_computed_tokens)
        local = num_total_computed_tokens - num_external_computed_tokens
        if request_id not in self.req_to_blocks and new_computed_blocks and local % self.block_size:
            return demand + 1  # the copy's destination (FPART-3)
        return demand

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        super().admit(request_id, new_computed_blocks, num_local_computed_tokens,
                      num_external_computed_tokens)
        if new_computed_blocks and num_local_computed_tokens % self.block_size:
            # The hit ends inside its last block, which other requests share:
            # copy it before writing; once full, the copy is cached anew.
            column = num_local_computed_tokens // self.block_size
            self.partial_hit[request_id] = (column, self.req_to_blocks[request_id][column])
            self.num_cached_blocks[request_id] = column

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[KVCacheBlock]:
        copied: list[KVCacheBlock] = []
        partial = self.partial_hit.pop(request_id, None)
        blocks = self.req_to_blocks[request_id]
        if partial is not None and blocks[partial[0]] is partial[1]:
            column, source = partial
            destination = self.block_pool.get_new_blocks(1)[0]
            blocks[column] = destination
            destination.ref_cnt += 1  # its retention; the hit's reference is the source's
            self.copies.append((source, destination))
            copied.append(destination)
        return copied + super().allocate_new_blocks(request_id, num_tokens, num_main_tokens)

    def take_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The queued copies, oldest first; the queue is emptied."""
        copies, self.copies = self.copies, []
        return copies

    # -- caching and freeing ------------------------------------------------------------

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        blocks = self.req_to_blocks[request_id]
        # A block that was published inside and is now full trades its
        # partial key for its full one (FPART-4; no event, D-MAMBA-18).
        for index in range(self.num_cached_blocks[request_id], min(num_tokens // self.block_size, len(blocks))):
            block = blocks[index]
            key = block.block_hash
            if key is not None and index < len(block_hashes) and key != make_block_hash_with_group_id(
                    block_hashes[index], self.group_id):
                holders = self.block_pool.cached[key]
                holders.remove(block)
                if not holders:
                    del self.block_pool.cached[key]
                block.block_hash = None
        super().cache_blocks(request, block_hashes, request_id, num_tokens)
        self._publish_prompt_tail(request, block_hashes, request_id, num_tokens)

    def _publish_prompt_tail(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                             request_id: str, num_tokens: int) -> None:
        """Key the block holding the prompt's last reusable hash boundary under
        that boundary's partial key once caching reaches it (FPART-2): only
        inside a block, on a real block; an unkeyed block takes it as its
        key, a block carrying its own full key as its extra entry
        (D-MAMBA-22)."""
        prompt = getattr(request, "num_prompt_tokens", None)
        if type(prompt) is not int:
            return
        hash_size = self.hash_block_size
        boundary = prompt_tail_boundary(prompt, len(request.block_hashes), hash_size, self.use_eagle)
        if boundary <= 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request_id]
        column = boundary // self.block_size
        if column >= len(blocks) or blocks[column].is_null:
            return
        block, partial = blocks[column], request.block_hashes[boundary // hash_size - 1]
        if block.block_hash is None:
            key_block(self.block_pool, block, partial, self.group_id, boundary)
            return
        if column >= len(block_hashes) or block.block_hash != make_block_hash_with_group_id(
                block_hashes[column], self.group_id):
            return
        old = self.extra_tail.get(block.block_id)
        if old is not None and old[0] != partial:
            holders = self.extra_holders[old[0]]
            holders.remove(block)
            if not holders:
                del self.extra_holders[old[0]]
        self.extra_tail[block.block_id] = (partial, block.block_hash)
        holders = self.extra_holders.setdefault(partial, [])
        if block not in holders:
            holders.append(block)

    def release(self, request_id: str) -> None:
        self.partial_hit.pop(request_id, None)
        super().release(request_id)
