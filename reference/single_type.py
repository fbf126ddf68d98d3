"""Single-type managers: one KV cache group's blocks per request
(spec/managers.md). This slice has full attention; the other attention
types subclass :class:`SingleTypeManager` and override its rule methods."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.types import BlockHash

__all__ = ["SingleTypeManager", "FullAttentionManager"]


class SingleTypeManager:
    """One group: per request, its blocks in token order and how many of
    them are cached (handed to the prefix cache, or hit from it)."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, block_size: int,
                 enable_caching: bool) -> None:
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    # -- rules an attention type overrides ----------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               use_eagle: bool) -> list[KVCacheBlock]:
        """The cached blocks serving the longest hit of at most ``max_length`` tokens."""
        raise NotImplementedError

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens attention no longer reads (0: none)."""
        return 0

    # -- allocation ---------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free blocks this group consumes to give ``num_tokens`` slots: new
        blocks, plus hit blocks that now leave the free queue."""
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return rules.num_new_blocks_needed(num_tokens, self.block_size, len(held))
        evictable = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null)
        return rules.num_new_blocks_needed(num_tokens, self.block_size, len(new_computed_blocks)) + evictable

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_total_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Start holding blocks for a new request: the hit blocks (touched),
        then fresh blocks for tokens an external connector computed."""
        if self.enable_caching:
            self.pool.touch(new_computed_blocks)
        blocks = list(new_computed_blocks)
        self.req_to_blocks[request_id] = blocks
        self.num_cached_blocks[request_id] = len(blocks)
        if num_external_computed_tokens > 0:
            missing = rules.num_new_blocks_needed(num_total_computed_tokens, self.block_size, len(blocks))
            blocks.extend(self.pool.get_new_blocks(missing))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append fresh blocks until ``num_tokens`` tokens have a slot."""
        blocks = self.req_to_blocks[request_id]
        new_blocks = self.pool.get_new_blocks(rules.num_new_blocks_needed(num_tokens, self.block_size, len(blocks)))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Hand the full blocks among the first ``num_tokens`` tokens to the prefix cache."""
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_blocks[request_id]
        if num_cached >= num_full:
            return
        self.pool.cache_full_blocks(request, self.req_to_blocks[request_id], num_cached, num_full,
                                    self.block_size, self.group_id)
        self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so the tail is evicted first."""
        blocks = self.req_to_blocks.pop(request_id)
        del self.num_cached_blocks[request_id]
        self.pool.free_blocks(reversed(blocks))

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of ``request_id`` held by every known request."""
        counts = [block.ref_cnt for block in self.req_to_blocks[request_id]]
        return rules.common_prefix_blocks(counts, len(self.req_to_blocks))


class FullAttentionManager(SingleTypeManager):
    """Full attention: every block is kept until the request ends; a hit is
    the longest prefix whose block hashes are all cached."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               use_eagle: bool) -> list[KVCacheBlock]:
        max_blocks = max_length // self.block_size
        lookups = [self.pool.get_cached_block(block_hash, [self.group_id])
                   for block_hash in block_hashes[:max_blocks]]
        num_hit = rules.prefix_hit_blocks([found is not None for found in lookups], max_blocks, use_eagle)
        return [found[0] for found in lookups[:num_hit] if found is not None]
