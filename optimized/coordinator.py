"""Coordinators: drive the per-group managers over one shared block pool.

A coordinator owns the pool and one single-type manager per KV cache group
and answers for all groups at once: how many blocks an allocation takes in
total, admit a request (every group takes its hit before any group
allocates, D-API-9), allocate in every group, cache, free group by group,
and find a prefix hit common to the groups. Kinds:

- :class:`NoPrefixCacheCoordinator`: caching disabled, or zero groups;
  never finds a hit.
- :class:`UnitaryCoordinator`: caching on, one full-attention group hashed
  at its own block size: the prefix scan of the full-attention slice.
- :class:`HybridCoordinator`: caching on, any number of groups of any
  types and block sizes (``hybrid_search``).

:func:`make_coordinator` picks the kind. Arguments are assumed valid: the
facade validates before calling (``check_cache_blocks`` aside).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError, InvalidTokenCountError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.types import BlockHash

from .block_pool import BlockPool
from .cross_attention import CrossAttentionManager
from .hybrid_search import HashViews, longest_common_hit
from .mamba import MambaManager
from .single_type import FullAttentionManager, GroupManager, SinkFullAttentionManager
from .windowed import ChunkedLocalAttentionManager, SlidingWindowManager

__all__ = [
    "KVCacheCoordinator",
    "NoPrefixCacheCoordinator",
    "UnitaryCoordinator",
    "HybridCoordinator",
    "MANAGER_FOR_KIND",
    "make_coordinator",
    "hit_alignment",
]

MANAGER_FOR_KIND: dict[str, type[GroupManager]] = {
    "full_attention": FullAttentionManager,
    "sink_full_attention": SinkFullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalAttentionManager,
    "mamba": MambaManager,
    "cross_attention": CrossAttentionManager,
}
"""The optimized manager for each manager kind of :mod:`pagedkv.spec.registry`."""


def hit_alignment(block_sizes: Sequence[int]) -> int:
    """The LCM of the block sizes (1 with none). Cost: O(groups)."""
    from math import lcm

    return lcm(*block_sizes) if block_sizes else 1


class KVCacheCoordinator:
    """Managers of every group over one pool; tracks the known requests.

    Args:
        kv_cache_config: groups and number of blocks.
        use_eagle: hits keep the next block cached (EAGLE rule).
        enable_caching: prefix caching on.
        enable_kv_cache_events: pool collects events.
        block_sizes: tokens per block of each group (spec size * dcp * pcp).
        hash_block_size: tokens per request block hash (divides every block size).
        retention_interval: sliding-window cache thinning (``windowed``).

    Raises:
        InvalidConfigError: a spec whose manager kind has no optimized manager,
            or a sink group the pool cannot hold.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, block_sizes: Sequence[int],
                 hash_block_size: int, retention_interval: int | None = None) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.kv_cache_config = kv_cache_config
        self.use_eagle = use_eagle
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.block_sizes = tuple(block_sizes)
        self.alignment = hit_alignment(self.block_sizes)
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events, num_groups=len(groups))
        managers: list[GroupManager] = []
        for group_id, group in enumerate(groups):
            kind = manager_kind_for(group.kv_cache_spec)
            manager_class = MANAGER_FOR_KIND.get(kind)
            if manager_class is None:
                raise InvalidConfigError(
                    f"kv_cache_groups[{group_id}]: manager kind {kind!r} has no optimized manager")
            managers.append(manager_class(
                group.kv_cache_spec, block_sizes[group_id], self.block_pool, group_id,
                enable_caching=enable_caching, alignment=self.alignment, use_eagle=use_eagle,
                retention_interval=retention_interval))
        self.managers: tuple[GroupManager, ...] = tuple(managers)
        # Cross-attention groups count encoder tokens, the others decoder tokens.
        self.encoder_groups: tuple[bool, ...] = tuple(
            isinstance(manager, CrossAttentionManager) for manager in managers)
        # Known requests (holding an allocation): needed apart from the
        # managers' tables because a config may have zero groups.
        self.requests: set[str] = set()

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """The prefix hit: blocks per group and the tokens they cover. Pure.

        Cost: depends on the kind.
        """
        raise NotImplementedError

    def views(self, block_hashes: Sequence[BlockHash], max_tokens: int | None = None) -> HashViews:
        """The request's hashes per group block size. Cost: O(1) (lazy)."""
        return HashViews(block_hashes, self.hash_block_size, max_tokens)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[list[int], ...] | None,
                                   num_total_computed_tokens: int, num_main_tokens: int,
                                   num_encoder_tokens: int, num_external_computed_tokens: int = 0) -> int:
        """Free blocks all groups take from the free queue. Cost: O(groups + hit blocks)."""
        total = 0
        for group_id, manager in enumerate(self.managers):
            computed: Sequence[int] = (
                () if new_computed_blocks is None else new_computed_blocks[group_id])
            if self.encoder_groups[group_id]:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, computed, num_total_computed_tokens,
                    num_encoder_tokens, num_external_computed_tokens)
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_tokens, computed, num_total_computed_tokens, num_main_tokens,
                    num_external_computed_tokens)
        return total

    def admit(self, request_id: str, new_computed_blocks: tuple[list[int], ...] | None,
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Make a new request known: every group takes its hit before any
        group allocates blocks for external tokens, which could otherwise
        evict another group's hit (D-API-9).
        Cost: O(groups + hit blocks + external blocks)."""
        self.requests.add(request_id)
        managers = self.managers
        for group_id, manager in enumerate(managers):
            computed: Sequence[int] = (
                () if new_computed_blocks is None else new_computed_blocks[group_id])
            manager.admit(request_id, computed, num_local_computed_tokens,
                          num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            total = num_local_computed_tokens + num_external_computed_tokens
            for manager in managers:
                manager.allocate_external(request_id, total, num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int,
                            num_encoder_tokens: int) -> tuple[list[int], ...]:
        """New blocks per group so the tokens have slots.
        Cost: O(groups + new blocks)."""
        return tuple([
            manager.allocate_new_blocks(request_id, num_encoder_tokens, num_encoder_tokens)
            if encoder else manager.allocate_new_blocks(request_id, num_tokens, num_main_tokens)
            for manager, encoder in zip(self.managers, self.encoder_groups)])

    def cache_blocks(self, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Cache the blocks ``num_tokens`` fill, in every group, each under
        its view of the request's hashes.
        Cost: O(groups + blocks newly cached + view blocks built)."""
        hash_block_size = self.hash_block_size
        views: HashViews | None = None
        for manager in self.managers:
            if manager.block_size == hash_block_size:
                manager.cache_blocks(request, None, request_id, num_tokens)
            else:
                if views is None:
                    views = self.views(request.block_hashes, num_tokens)
                manager.cache_blocks(request, views.at(manager.block_size), request_id, num_tokens)

    def check_cache_blocks(self, request: HashedRequest, request_id: str,
                           num_computed_tokens: int) -> None:
        """Validate :meth:`cache_blocks`'s arguments for the facade's public
        ``cache_blocks`` (the one method here that checks its arguments):
        every group (cross-attention aside) must hold the blocks and have the
        hashes ``num_computed_tokens`` fill. Cost: O(groups).

        Raises:
            InvalidTokenCountError: ``num_computed_tokens`` is not an int >= 0.
            InvalidArgumentError: a group holds fewer blocks or hashes.
        """
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            raise InvalidTokenCountError(
                f"num_computed_tokens must be an int >= 0, got {num_computed_tokens!r}")
        for group_id, (manager, encoder) in enumerate(zip(self.managers, self.encoder_groups)):
            if encoder:
                continue  # cross-attention blocks are never cached
            block_size = manager.block_size
            blocks = manager.req_to_blocks[request_id]
            num_full = num_computed_tokens // block_size
            num_hashes = len(request.block_hashes) * self.hash_block_size // block_size
            if num_full > len(blocks) or num_full > num_hashes:
                raise InvalidArgumentError(
                    f"request {request_id!r}: {num_computed_tokens} tokens fill {num_full} "
                    f"blocks of group {group_id} but it holds {len(blocks)} blocks and "
                    f"hashes for {num_hashes}")

    def remove_skipped_blocks(self, request_id: str, num_total_computed: int) -> None:
        """Release blocks no longer needed, per group. Cost: O(groups + released)."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_total_computed)

    def release(self, request_id: str) -> None:
        """Release the request's blocks group by group (tail first within a
        group) and forget it. Cost: O(blocks held)."""
        self.requests.remove(request_id)
        for manager in self.managers:
            manager.release(request_id)

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
        return tuple(manager.cached_count[request_id] for manager in self.managers)

    def new_step_starts(self) -> None:
        """Per-step hook of every manager. Cost: O(groups)."""
        for manager in self.managers:
            manager.new_step_starts()


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching disabled (any number of groups), or no groups. Never hits."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """No hit: empty lists per group, 0 tokens. Cost: O(groups)."""
        return tuple([] for _ in self.managers), 0


class UnitaryCoordinator(KVCacheCoordinator):
    """Caching on, one full-attention group hashed at its block size."""

    def __init__(self, kv_cache_config: KVCacheConfig, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, block_sizes: Sequence[int],
                 hash_block_size: int, retention_interval: int | None = None) -> None:
        super().__init__(kv_cache_config, use_eagle, enable_caching, enable_kv_cache_events,
                         block_sizes, hash_block_size, retention_interval)
        self.block_size = block_sizes[0]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """The group's hit and ``blocks * block_size`` tokens.
        Cost: O(blocks hit + 1)."""
        hit = FullAttentionManager.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, (0,), self.block_pool, self.block_size,
            self.use_eagle)
        return hit, len(hit[0]) * self.block_size


class HybridCoordinator(KVCacheCoordinator):
    """Caching on, any groups: the longest hit every group can serve
    (``hybrid_search.longest_common_hit``)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """Blocks per group (null blocks where a type no longer reads) and
        the hit length. Cost: see ``longest_common_hit``, plus the hit blocks."""
        views = self.views(block_hashes, max_cache_hit_length)
        managers = self.managers
        length = longest_common_hit(managers, views, max_cache_hit_length, self.alignment)
        if length == 0:
            return tuple([] for _ in managers), 0
        return tuple([manager.hit_blocks(views.at(manager.block_size), length)
                      for manager in managers]), length


def make_coordinator(kv_cache_config: KVCacheConfig, use_eagle: bool, enable_caching: bool,
                     enable_kv_cache_events: bool, block_sizes: Sequence[int],
                     hash_block_size: int, retention_interval: int | None = None) -> KVCacheCoordinator:
    """The coordinator kind for this configuration.

    Cost: O(num_blocks) (the pool).

    Raises:
        InvalidConfigError: a spec type without a manager.
    """
    groups = kv_cache_config.kv_cache_groups
    kind: type[KVCacheCoordinator]
    if not enable_caching or not groups:
        # Zero groups (an attention-free model): nothing to cache or hit.
        kind = NoPrefixCacheCoordinator
    elif (len(groups) == 1 and block_sizes[0] == hash_block_size
          and manager_kind_for(groups[0].kv_cache_spec) == "full_attention"):
        kind = UnitaryCoordinator
    else:
        kind = HybridCoordinator
    return kind(kv_cache_config, use_eagle, enable_caching, enable_kv_cache_events,
                block_sizes, hash_block_size, retention_interval)
