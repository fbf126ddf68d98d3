"""Coordinators: the managers of every KV cache group, driven together
(spec/coordinators.md)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.single_type import FullAttentionManager, SingleTypeManager
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from pagedkv.spec.types import BlockHash

__all__ = ["Coordinator", "UnitaryCoordinator", "NoPrefixCacheCoordinator", "make_coordinator"]

MANAGER_FOR_SPEC: dict[type[KVCacheSpec], type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
}
"""Which manager serves each spec type (issue 5 adds the other types)."""


class Coordinator:
    """Holds one single-type manager per group and the set of known requests."""

    def __init__(self, config: KVCacheConfig, pool: BlockPool, enable_caching: bool,
                 block_sizes: Sequence[int]) -> None:
        self.pool = pool
        self.managers: list[SingleTypeManager] = []
        for group_id, (group, block_size) in enumerate(zip(config.kv_cache_groups, block_sizes)):
            manager_type = MANAGER_FOR_SPEC.get(type(group.kv_cache_spec))
            if manager_type is None:
                raise InvalidConfigError(
                    f"kv_cache_groups[{group_id}].kv_cache_spec: {type(group.kv_cache_spec).__name__} "
                    "is not supported yet (this version manages FullAttentionSpec groups)")
            self.managers.append(manager_type(group.kv_cache_spec, pool, group_id, block_size, enable_caching))
        self.known: set[str] = set()

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               use_eagle: bool) -> tuple[list[KVCacheBlock], ...]:
        """Hit blocks per group (empty without a prefix cache)."""
        raise NotImplementedError

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[KVCacheBlock]]) -> int:
        """Free blocks all groups together consume for this allocation."""
        return sum(manager.get_num_blocks_to_allocate(request_id, num_tokens, hits)
                   for manager, hits in zip(self.managers, new_computed_blocks))

    def admit(self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
              num_total_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Make ``request_id`` known, holding its hit blocks in every group."""
        self.known.add(request_id)
        for manager, hits in zip(self.managers, new_computed_blocks):
            manager.admit(request_id, hits, num_total_computed_tokens, num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Fresh blocks per group so ``num_tokens`` tokens have slots."""
        return tuple(manager.allocate_new_blocks(request_id, num_tokens) for manager in self.managers)

    def cache_blocks(self, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Cache the full blocks of every group."""
        for manager in self.managers:
            manager.cache_blocks(request, request_id, num_tokens)

    def free(self, request_id: str) -> None:
        """Release every group's blocks, group by group."""
        self.known.remove(request_id)
        for manager in self.managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's blocks per group."""
        return tuple(list(manager.req_to_blocks[request_id]) for manager in self.managers)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Common prefix blocks per group."""
        return [manager.get_num_common_prefix_blocks(request_id) for manager in self.managers]


class UnitaryCoordinator(Coordinator):
    """Prefix caching with exactly one group."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               use_eagle: bool) -> tuple[list[KVCacheBlock], ...]:
        return (self.managers[0].find_longest_cache_hit(block_hashes, max_length, use_eagle),)


class NoPrefixCacheCoordinator(Coordinator):
    """No prefix cache: any number of groups, never a hit."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               use_eagle: bool) -> tuple[list[KVCacheBlock], ...]:
        return tuple([] for _ in self.managers)


def make_coordinator(config: KVCacheConfig, pool: BlockPool, enable_caching: bool,
                     block_sizes: Sequence[int]) -> Coordinator:
    """The coordinator for a configuration.

    Raises:
        InvalidConfigError: prefix caching with other than one group (the
            hybrid coordinator comes with the other attention types).
    """
    if not enable_caching:
        return NoPrefixCacheCoordinator(config, pool, enable_caching, block_sizes)
    if len(config.kv_cache_groups) != 1:
        raise InvalidConfigError(
            f"prefix caching needs exactly one KV cache group in this version, got "
            f"{len(config.kv_cache_groups)} (hybrid models: pass enable_caching=False for now)")
    return UnitaryCoordinator(config, pool, enable_caching, block_sizes)
