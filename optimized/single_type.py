"""Per-group managers: one KV cache group's block lists, by attention type.

A single-type manager owns, for one KV cache group, each known request's
block list (token order) and its count of cached (hashed) blocks
(REQ-2). What differs between attention types is which blocks a request
still needs (skipped positions), how a prefix hit is found, and how many
blocks an allocation takes; each type overrides those hooks. This slice
implements full attention; sliding window, chunked local, Mamba,
cross-attention and sink managers subclass :class:`SingleTypeKVCacheManager`
and register in :data:`MANAGER_REGISTRY`.

All methods assume validated arguments: the facade (``manager.py``)
validates and raises typed errors before calling in.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from pagedkv.spec.types import BlockHash

from .block_pool import BlockPool

__all__ = [
    "SingleTypeKVCacheManager",
    "FullAttentionManager",
    "MANAGER_REGISTRY",
    "make_single_type_manager",
]


class SingleTypeKVCacheManager:
    """Block lists of one KV cache group.

    Args:
        kv_cache_spec: the group's spec.
        block_size: tokens per block (spec block size times dcp * pcp).
        block_pool: the shared pool.
        group_id: this group's index.
    """

    __slots__ = ("kv_cache_spec", "block_size", "block_pool", "group_id",
                 "req_to_blocks", "num_cached_block")

    def __init__(self, kv_cache_spec: KVCacheSpec, block_size: int, block_pool: BlockPool,
                 group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}

    # ------------------------------------------------------------ hooks

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        block_size: int,
        use_eagle: bool,
    ) -> tuple[list[int], ...]:
        """The longest cached prefix of at most ``max_length`` tokens, one
        block list per group in ``group_ids``. Pure: touches nothing.

        Cost: O(blocks hit + 1) per group.
        """
        raise NotImplementedError

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose blocks the request no longer needs. Cost: O(1)."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks of skipped positions (replaced by the null block).
        Cost: O(blocks released)."""

    def new_step_starts(self) -> None:
        """Per-step bookkeeping hook. Cost: O(1)."""

    # --------------------------------------------------- allocation

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int]) -> int:
        """Blocks this group takes from the free queue so that ``num_tokens``
        tokens have slots: new blocks, plus computed blocks that are free now
        (touching them removes them from the queue).

        Cost: O(1) for a known request, O(len(new_computed_blocks)) otherwise.
        """
        block_size = self.block_size
        required = -(-num_tokens // block_size)
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return max(required - len(held), 0)
        ref = self.block_pool.ref_counts
        num_evictable = 0
        for block in new_computed_blocks:
            if ref[block] == 0:
                num_evictable += 1
        return max(required - len(new_computed_blocks), 0) + num_evictable

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[int],
        num_local_computed_tokens: int, num_external_computed_tokens: int,
    ) -> None:
        """Make a new request known: take the prefix-hit blocks (touching
        them when caching), count them as cached, and allocate blocks for
        externally computed tokens. No-op for a known request.

        Cost: O(len(new_computed_blocks) + external blocks).
        """
        if request_id in self.req_to_blocks:
            return
        pool = self.block_pool
        blocks = list(new_computed_blocks)
        if blocks and pool.enable_caching:
            pool._touch(blocks)
        self.req_to_blocks[request_id] = blocks
        self.num_cached_block[request_id] = len(blocks)
        if num_external_computed_tokens > 0:
            total = num_local_computed_tokens + num_external_computed_tokens
            missing = -(-total // self.block_size) - len(blocks)
            if missing > 0:
                blocks.extend(pool.get_new_blocks(missing))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocate blocks so that ``num_tokens`` tokens have slots; returns
        the new blocks (possibly none).

        Cost: O(new blocks).
        """
        blocks = self.req_to_blocks[request_id]
        missing = -(-num_tokens // self.block_size) - len(blocks)
        if missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(missing)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Hash the request's blocks that ``num_tokens`` tokens fill and that
        are not cached yet.

        Cost: O(blocks newly cached).
        """
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block[request_id]
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request_id], num_cached, num_full,
            self.block_size, self.group_id)
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first and forget it.

        Cost: O(blocks held).
        """
        blocks = self.req_to_blocks.pop(request_id)
        del self.num_cached_block[request_id]
        self.block_pool._free(reversed(blocks))

    def get_num_common_prefix_blocks(self, request_id: str, num_requests: int) -> int:
        """Leading blocks of the request held by all ``num_requests`` known
        requests (ref count equal to it).

        Cost: O(common blocks + 1).
        """
        ref = self.block_pool.ref_counts
        count = 0
        for block in self.req_to_blocks[request_id]:
            if ref[block] != num_requests:
                break
            count += 1
        return count


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full (causal) attention: every position keeps its block; a hit is
    the longest run of cached leading blocks."""

    __slots__ = ()

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        block_size: int,
        use_eagle: bool,
    ) -> tuple[list[int], ...]:
        """See the base class. With ``use_eagle`` one matched block is
        dropped so the drafter recomputes its hidden states.

        Cost: O(blocks hit + 1) per group.
        """
        max_blocks = max_length // block_size
        if len(group_ids) == 1:
            # Single group: probe the raw-hash table directly (no key bytes
            # built per block). Locals bound for the loop.
            table_get = block_pool.cached_by_group[group_ids[0]].get
            hit: list[int] = []
            append = hit.append
            for block_hash in block_hashes[:max_blocks]:
                holders = table_get(block_hash)
                if holders is None:
                    break
                append(holders[0])
            if use_eagle and hit:
                hit.pop()
            return (hit,)
        per_group: tuple[list[int], ...] = tuple([] for _ in group_ids)
        for block_hash in block_hashes[:max_blocks]:
            found = block_pool.get_cached_block(block_hash, group_ids)
            if found is None:
                break
            for group_blocks, block in zip(per_group, found):
                group_blocks.append(block)
        if use_eagle and per_group and per_group[0]:
            for group_blocks in per_group:
                group_blocks.pop()
        return per_group


MANAGER_REGISTRY: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
}
"""Manager class per spec type (exact type). Other attention types register
here as they are implemented."""


def make_single_type_manager(kv_cache_spec: KVCacheSpec, block_size: int,
                             block_pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    """The manager for one group, chosen by the spec's exact type.

    Cost: O(1).

    Raises:
        InvalidConfigError: no manager handles this spec type yet.
    """
    manager_class = MANAGER_REGISTRY.get(type(kv_cache_spec))
    if manager_class is None:
        raise InvalidConfigError(
            f"kv_cache_groups[{group_id}].kv_cache_spec: expected one of "
            f"{sorted(cls.__name__ for cls in MANAGER_REGISTRY)}, got "
            f"{type(kv_cache_spec).__name__} (other attention types are not supported yet)")
    return manager_class(kv_cache_spec, block_size, block_pool, group_id)
