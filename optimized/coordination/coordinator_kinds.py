"""The coordinator kinds, and :func:`make_coordinator`, which picks one
(the base class, :class:`.coordinator.KVCacheCoordinator`, holds what they
share):

- :class:`NoPrefixCacheCoordinator`: caching disabled, or zero groups;
  never finds a hit.
- :class:`UnitaryCoordinator`: caching on, one full-attention group hashed
  at its own block size: the prefix scan of the full-attention slice, and
  the per-request calls with the group's layers called directly
  (D-PERF-45).
- :class:`HybridCoordinator`: caching on, any number of groups of any
  types and block sizes (``hybrid_search``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator
from pagedkv.optimized.groups.hybrid_search import longest_common_hit
from pagedkv.optimized.groups.single_type import FullAttentionManager
from pagedkv.optimized.native import NATIVE, ReleaseContext
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.hit_memo import remember
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.types import BlockHash

__all__ = ["HybridCoordinator", "NoPrefixCacheCoordinator", "UnitaryCoordinator", "make_coordinator"]


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching disabled (any number of groups), or no groups. Never hits."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """No hit: empty lists per group, 0 tokens. Cost: O(groups)."""
        return tuple([] for _ in self.managers), 0


class UnitaryCoordinator(KVCacheCoordinator):
    """Caching on, one full-attention group hashed at its block size."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """The group's hit and ``blocks * block_size`` tokens.
        Cost: O(blocks hit + 1)."""
        manager = self.managers[0]
        assert isinstance(manager, FullAttentionManager)
        # The group's scan in C called here directly (D-PERF-45), as
        # FullAttentionManager.find_longest_cache_hit calls it without EAGLE;
        # it leaves the pool's lookup memo too (admitting the hit then probes
        # no more, D-PERF-44), in the same call (D-PERF-48).
        pool = self.block_pool
        hit = (None if NATIVE is None or manager.use_eagle else NATIVE.prefix_hits(
            pool.cached_by_group[0], block_hashes, max_cache_hit_length // manager.block_size, pool))
        if hit is None:
            hit = manager.find_longest_cache_hit(block_hashes, max_cache_hit_length)
            if hit:
                remember(pool, block_hashes, hit)
        return (hit,), len(hit) * manager.block_size


    def one_group_scan(self) -> tuple[Callable[..., list[int] | None], dict[bytes, int], int, BlockPool] | None:
        """``(prefix_hits, table, block_size, pool)`` when the lookup above
        is the C scan alone (built, no EAGLE, plain full attention): the
        manager calls it with them, a call less per lookup (D-PERF-48);
        otherwise None. Cost: O(1)."""
        manager = self.managers[0]
        if NATIVE is None or manager.use_eagle or type(manager) is not FullAttentionManager:
            return None
        pool = self.block_pool
        return NATIVE.prefix_hits, pool.cached_by_group[0], manager.block_size, pool

    def native_release(self) -> Callable[[str], None] | None:
        """:meth:`release` in C (``_native.release_request``, D-PERF-49) when
        the group is plain full attention and the C modules are built: the
        same steps on the same tables, anything unusual handed to the method
        before any change. Otherwise None. Cost: O(1)."""
        manager = self.managers[0]
        if NATIVE is None or type(manager) is not FullAttentionManager:
            return None
        pool = self.block_pool
        queue = pool._queue
        # The method unbound from this instance's attribute lookup, so the C code never calls itself.
        context = ReleaseContext(
            python_release=partial(UnitaryCoordinator.release, self), requests=self.requests,
            blocks_of=manager.req_to_blocks, cached_of=manager.num_cached_blocks, ref=pool._ref, gids=pool._gid,
            prev=queue.prev, next=queue.next, sentinel=queue.sentinel, queue=queue, free_held=pool.free_held)
        return partial(NATIVE.release_request, context)

    def release(self, request_id: str) -> None:
        """The base class's release for the one group, its layers called
        here directly when the group is plain full attention (D-PERF-45):
        the list tail first into ``BlockPool.free_held``. Cost: O(blocks held)."""
        manager = self.managers[0]
        if type(manager) is not FullAttentionManager:
            super().release(request_id)
            return
        self.requests.remove(request_id)
        blocks = manager.req_to_blocks.pop(request_id)
        del manager.num_cached_blocks[request_id]
        blocks.reverse()  # the list is ours and dropped: reversing in place is free
        pool = self.block_pool
        queue = pool._queue
        released = None if NATIVE is None else NATIVE.release(
            pool._ref, pool._gid, queue.prev, queue.next, queue.sentinel, blocks)
        if released is None:
            pool.free_held(blocks)
        else:
            queue.size += released


class HybridCoordinator(KVCacheCoordinator):
    """Caching on, any groups: the longest hit every group can serve
    (``hybrid_search.longest_common_hit``)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """Blocks per group (null blocks where a type no longer reads) and
        the hit length. Cost: see ``longest_common_hit``, plus the hit blocks."""
        managers = self.managers
        cacheable = self.cacheable
        # With sub-block hits every group reads the hash-block hashes (MPART-1).
        views = self.views(block_hashes, max_cache_hit_length)
        # A group outside prefix caching serves every length with no block (PFX-1).
        peek = self.peek_limit(block_hashes, max_cache_hit_length)
        # LOOKUP-3; HYB-1 holds it to the reference's brute force.
        length = longest_common_hit(self.cacheable_managers, views, max_cache_hit_length, self.hit_unit, peek)
        if length == 0:
            return tuple([] for _ in managers), 0
        hashed = len(block_hashes) * self.hash_block_size  # LOOKUP-4: each group's blocks for the length
        return tuple([manager.hit_blocks(views.at(manager.block_size), length,
                                         manager.lookup_limit(max_cache_hit_length, peek, hashed)) if c else []
                      for manager, c in zip(managers, cacheable)]), length


def make_coordinator(kv_cache_config: KVCacheConfig, *, block_pool: BlockPool,
                     block_sizes: Sequence[int], hash_block_size: int, enable_caching: bool,
                     use_eagle: bool, retention_interval: int | None, max_model_len: int,
                     max_num_batched_tokens: int) -> KVCacheCoordinator:
    """The coordinator kind for this configuration (arguments as
    :class:`KVCacheCoordinator`'s).

    Cost: O(groups) (sink groups: plus their blocks).

    Raises:
        InvalidConfigError: a spec type without a manager.
    """
    groups = kv_cache_config.kv_cache_groups
    kind: type[KVCacheCoordinator]
    if not enable_caching or not any(prefix_cacheable(group.kv_cache_spec) for group in groups):
        # Zero groups (an attention-free model): nothing to cache or hit.
        kind = NoPrefixCacheCoordinator
    elif (len(groups) == 1 and block_sizes[0] == hash_block_size
          and manager_kind_for(groups[0].kv_cache_spec) == "full_attention"):
        kind = UnitaryCoordinator
    else:
        kind = HybridCoordinator
    return kind(kv_cache_config, block_pool=block_pool, block_sizes=block_sizes,
                hash_block_size=hash_block_size, enable_caching=enable_caching, use_eagle=use_eagle,
                retention_interval=retention_interval,
                max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
