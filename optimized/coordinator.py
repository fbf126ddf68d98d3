"""Coordinators: drive the per-group managers over one shared block pool.

A coordinator owns the pool and one single-type manager per KV cache group
and answers for all groups at once: how many blocks an allocation takes in
total, allocate in every group, cache, free group by group, and find a
prefix hit common to the groups. Kinds:

- :class:`NoPrefixCacheCoordinator`: caching disabled, any number of groups
  (zero included), or zero groups with caching on; never finds a hit.
- :class:`UnitaryCoordinator`: caching enabled, exactly one group; a hit is
  that group's manager's hit.
- A hybrid coordinator (several groups with caching; issue 5) subclasses
  :class:`KVCacheCoordinator` and overrides :meth:`find_longest_cache_hit`.

:func:`make_coordinator` picks the kind. Arguments are assumed valid: the
facade validates before calling.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

from .block_pool import BlockPool
from .single_type import SingleTypeKVCacheManager, make_single_type_manager

__all__ = [
    "KVCacheCoordinator",
    "NoPrefixCacheCoordinator",
    "UnitaryCoordinator",
    "make_coordinator",
]


class KVCacheCoordinator:
    """Managers of every group over one pool; tracks the known requests.

    Args:
        kv_cache_config: groups and number of blocks.
        use_eagle: drop the last matched block of a hit.
        enable_caching: prefix caching on.
        enable_kv_cache_events: pool collects events.
        block_sizes: tokens per block of each group (spec size * dcp * pcp).
        hash_block_size: tokens per request block hash.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, block_sizes: Sequence[int],
                 hash_block_size: int) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.kv_cache_config = kv_cache_config
        self.use_eagle = use_eagle
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events, num_groups=len(groups))
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_single_type_manager(group.kv_cache_spec, block_sizes[group_id],
                                     self.block_pool, group_id)
            for group_id, group in enumerate(groups))
        # Known requests (holding an allocation): needed apart from the
        # managers' tables because a config may have zero groups.
        self.requests: set[str] = set()

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """The prefix hit: blocks per group and the tokens they cover. Pure.

        Cost: depends on the kind (O(blocks hit + 1) for unitary).
        """
        raise NotImplementedError

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[list[int], ...] | None,
                                   num_encoder_tokens: int) -> int:
        """Blocks all groups take from the free queue. Cost: O(groups + hit blocks)."""
        total = 0
        for group_id, manager in enumerate(self.managers):
            computed: Sequence[int] = (
                () if new_computed_blocks is None else new_computed_blocks[group_id])
            total += manager.get_num_blocks_to_allocate(request_id, num_tokens, computed)
        return total

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[list[int], ...] | None,
        num_local_computed_tokens: int, num_external_computed_tokens: int,
    ) -> None:
        """Make a new request known in every group (no-op when known).
        Cost: O(groups + hit blocks + external blocks)."""
        if request_id in self.requests:
            return
        self.requests.add(request_id)
        for group_id, manager in enumerate(self.managers):
            computed: Sequence[int] = (
                () if new_computed_blocks is None else new_computed_blocks[group_id])
            manager.allocate_new_computed_blocks(
                request_id, computed, num_local_computed_tokens, num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_encoder_tokens: int) -> tuple[list[int], ...]:
        """New blocks per group so ``num_tokens`` tokens have slots.
        Cost: O(groups + new blocks)."""
        return tuple([manager.allocate_new_blocks(request_id, num_tokens)
                      for manager in self.managers])

    def cache_blocks(self, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Cache the blocks ``num_tokens`` fill, in every group.
        Cost: O(groups + blocks newly cached)."""
        for manager in self.managers:
            manager.cache_blocks(request, request_id, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no longer needed, per group. Cost: O(groups + released)."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks group by group (tail first within a
        group) and forget it. Cost: O(blocks held)."""
        self.requests.remove(request_id)
        for manager in self.managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, leading blocks every known request holds.
        Cost: O(groups + common blocks)."""
        num_requests = len(self.requests)
        return [manager.get_num_common_prefix_blocks(request_id, num_requests)
                for manager in self.managers]

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        """The request's live block lists per group. Cost: O(groups)."""
        return tuple([manager.req_to_blocks[request_id] for manager in self.managers])

    def get_num_cached_blocks(self, request_id: str) -> tuple[int, ...]:
        """The request's cached-block count per group. Cost: O(groups)."""
        return tuple(manager.num_cached_block[request_id] for manager in self.managers)

    def new_step_starts(self) -> None:
        """Per-step hook of every manager. Cost: O(groups)."""
        for manager in self.managers:
            manager.new_step_starts()


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching disabled; any number of groups. Never hits."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """No hit: empty lists per group, 0 tokens. Cost: O(groups)."""
        return tuple([] for _ in self.managers), 0


class UnitaryCoordinator(KVCacheCoordinator):
    """Caching enabled with exactly one group."""

    def __init__(self, kv_cache_config: KVCacheConfig, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, block_sizes: Sequence[int],
                 hash_block_size: int) -> None:
        super().__init__(kv_cache_config, use_eagle, enable_caching, enable_kv_cache_events,
                         block_sizes, hash_block_size)
        self.manager = self.managers[0]
        self.block_size = block_sizes[0]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """The group's hit and ``blocks * block_size`` tokens.
        Cost: O(blocks hit + 1)."""
        manager = self.manager
        hit = manager.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, (0,), self.block_pool, self.block_size,
            self.use_eagle)
        return hit, len(hit[0]) * self.block_size


def make_coordinator(kv_cache_config: KVCacheConfig, use_eagle: bool, enable_caching: bool,
                     enable_kv_cache_events: bool, block_sizes: Sequence[int],
                     hash_block_size: int) -> KVCacheCoordinator:
    """The coordinator kind for this configuration.

    Cost: O(num_blocks) (the pool).

    Raises:
        InvalidConfigError: caching with more than one group (hybrid support
            comes later) or a spec type without a manager.
    """
    num_groups = len(kv_cache_config.kv_cache_groups)
    if not enable_caching or num_groups == 0:
        # Zero groups (an attention-free model): nothing to cache or hit.
        return NoPrefixCacheCoordinator(kv_cache_config, use_eagle, enable_caching,
                                        enable_kv_cache_events, block_sizes, hash_block_size)
    if num_groups == 1:
        return UnitaryCoordinator(kv_cache_config, use_eagle, enable_caching,
                                  enable_kv_cache_events, block_sizes, hash_block_size)
    raise InvalidConfigError(
        f"kv_cache_groups: prefix caching needs exactly one KV cache group for now, got "
        f"{num_groups} (hybrid support for several groups comes later)")
