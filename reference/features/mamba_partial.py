"""Sub-block (partial) prefix hits for Mamba ``align`` groups and the
copy-on-write they need (spec/mamba.md, "Sub-block hits", MPART-1..4).

Brute force on purpose: keys are placed and moved by editing the pool's
dict directly, one block at a time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features.dcp_rules import check_dcp_world_size, partial_hits_configured_under_dcp
from pagedkv.reference.features.eagle_rules import sub_block_eagle_limit
from pagedkv.reference.features.mamba_partial_rules import (
    check_supported,
    hit_fits,
    partial_hits_supported,
    shared_prefix_checkpoint_supported,
)
from pagedkv.reference.hooks import Feature
from pagedkv.reference.single_type import FullAttentionManager, SingleTypeManager
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.types import BlockHash, BlockHashWithGroupId, make_block_hash_with_group_id

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["SubBlockHits", "key_block", "move_key", "hit_padding"]


def key_block(pool: BlockPool, block: KVCacheBlock, block_hash: BlockHash, group_id: int,
              num_tokens: int) -> BlockHashWithGroupId:
    """Give an unkeyed block the key ``block_hash`` of the state after
    ``num_tokens`` tokens (no event: D-MAMBA-18)."""
    assert block.block_hash is None and not block.is_null
    key = make_block_hash_with_group_id(block_hash, group_id)
    block.block_hash = key
    block.key_tokens = num_tokens
    pool.cached.setdefault(key, []).append(block)
    return key


def move_key(pool: BlockPool, source: KVCacheBlock, destination: KVCacheBlock) -> None:
    """Re-point ``source``'s key, if any, at the unkeyed ``destination``, which
    takes ``source``'s place among the key's holders (no event: the entry
    stays live)."""
    key = source.block_hash
    assert destination.block_hash is None
    if key is None:
        return
    holders = pool.cached[key]
    holders[holders.index(source)] = destination
    source.block_hash = None
    destination.block_hash = key
    destination.key_tokens = source.key_tokens


def hit_padding(num_tokens: int, block_size: int) -> int:
    """Null blocks before the state block of a hit of ``num_tokens`` tokens."""
    return rules.cdiv(num_tokens, block_size) - 1


class SubBlockHits(Feature):
    """Sub-block hits (MPART-1..6, FPART-1..5): switched on by
    :meth:`enable` before any request. Mamba groups and full-attention groups
    larger than the hash block then hit at hash-block granularity (H3) and
    take such hits (H4); the copies they queue, and those taken and not yet
    released, hold one retention reference per endpoint (H7, MPART-3)."""

    def __init__(self) -> None:
        self.retained: Counter[int] = Counter()  # taken copy endpoints, with multiplicity

    def enable(self, coordinator: KVCacheCoordinator, dcp_world_size: int, shared_prefix_checkpoint: bool) -> None:
        """Turn sub-block hits on; ``dcp_world_size``: the decode context
        parallelism the block sizes already reflect (D-MAMBA-20);
        ``shared_prefix_checkpoint``: Mamba groups also publish the state
        at an observed junction (MPART-6, D-MAMBA-40).

        Raises:
            InvalidConfigError: an unsupported configuration (D-MAMBA-15,
                D-MAMBA-21, D-MAMBA-40), requests already known, or a
                malformed ``dcp_world_size`` (no change).
        """
        from pagedkv.reference.features.dcp_partial import FullAttentionSubBlockManager  # it imports this module
        from pagedkv.reference.features.mamba_states import MambaStateManager  # it imports this module

        specs = [group.kv_cache_spec for group in coordinator.kv_cache_groups]
        kinds = [manager_kind_for(spec) for spec in specs]
        hash_block_size = coordinator.hash_block_size
        configured = coordinator.enable_caching and partial_hits_configured_under_dcp(
            kinds, specs, coordinator.block_sizes, hash_block_size, check_dcp_world_size(dcp_world_size))
        check_supported(partial_hits_supported(
            kinds, specs, coordinator.block_sizes, hash_block_size, enable_caching=coordinator.enable_caching,
            use_eagle=coordinator.use_eagle, configured=configured))
        if shared_prefix_checkpoint:
            check_supported(shared_prefix_checkpoint_supported(
                partial_hits_on=True, eagle_groups=coordinator.use_eagle,
                num_reprefillable_tokens=coordinator.num_reprefillable_tokens))
        if coordinator.known:
            raise InvalidConfigError("enable_partial_hash_hits: requests are already known")
        coordinator.partial_hits_enabled = True
        coordinator.hit_unit = hash_block_size
        for index, manager in enumerate(coordinator.managers):
            if isinstance(manager, MambaStateManager):
                manager.cache_hit_alignment_tokens = hash_block_size
                manager.partial_hits = manager.block_size != hash_block_size
                manager.sub_block_hits = True
                manager.shared_prefix_checkpoint = shared_prefix_checkpoint
            elif type(manager) is FullAttentionManager and manager.block_size != hash_block_size:
                coordinator.managers[index] = FullAttentionSubBlockManager.replacing(manager, hash_block_size)

    @staticmethod
    def _sub_block(coordinator: KVCacheCoordinator, manager: SingleTypeManager) -> bool:
        return coordinator.partial_hits_enabled and hasattr(manager, "partial_hit")

    def lookup(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager,
               block_hashes: Sequence[BlockHash], max_length: int) -> tuple[Sequence[BlockHash], int] | None:
        if not self._sub_block(coordinator, manager):
            return None
        if manager.use_eagle:  # one hash block past the cap, then given back (FPART-5)
            hashed = len(block_hashes) * coordinator.hash_block_size
            return list(block_hashes), sub_block_eagle_limit(max_length, hashed, coordinator.hash_block_size)
        return list(block_hashes), max_length

    def accepts_hit(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager, num_tokens: int,
                    num_blocks: int, num_external_computed_tokens: int) -> bool:
        return bool(getattr(manager, "partial_hits", False)) and hit_fits(
            num_tokens, num_blocks, manager.block_size, coordinator.hash_block_size, True)

    def _queues(self, coordinator: KVCacheCoordinator) -> list[list[tuple[KVCacheBlock, KVCacheBlock]]]:
        from pagedkv.reference.features.dcp_partial import FullAttentionSubBlockManager  # it imports this module
        from pagedkv.reference.features.mamba_states import MambaStateManager  # it imports this module

        return [manager.copies for manager in coordinator.managers
                if isinstance(manager, (MambaStateManager, FullAttentionSubBlockManager))]

    def held_blocks(self, coordinator: KVCacheCoordinator) -> Iterable[int]:
        queued = [block.block_id for copies in self._queues(coordinator) for pair in copies for block in pair]
        return [*self.retained.elements(), *queued]

    def take_copies(self, coordinator: KVCacheCoordinator, hand_over: bool) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Every group's queued copies, groups in id order; their retention
        references pass to the caller (MPART-3): tracked until
        :meth:`release_retentions`, or with ``hand_over`` plain references
        the caller frees itself (D-MAMBA-19)."""
        pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for copies in self._queues(coordinator):
            pairs.extend(copies)
            copies.clear()
        if not hand_over:
            self.retained.update(block.block_id for pair in pairs for block in pair)
        return pairs

    def release_retentions(self, coordinator: KVCacheCoordinator, block_ids: Sequence[int]) -> None:
        """Drop one retention reference per id, in order (MPART-3).

        Raises:
            InvalidArgumentError: an id not retained that many times (no change).
        """
        wanted = Counter(block_ids)
        for block_id, times in wanted.items():
            if self.retained[block_id] < times:
                raise InvalidArgumentError(
                    f"block_ids: block {block_id!r} is released {times} time(s) but retained "
                    f"{self.retained[block_id]} time(s) by taken copies")
        self.retained.subtract(wanted)
        self.retained = +self.retained
        pool = coordinator.block_pool
        pool.free_blocks([pool.blocks[block_id] for block_id in block_ids])

    def check(self, coordinator: KVCacheCoordinator) -> str | None:
        # MPART-2: a recorded partial hit names the real block at its column.
        for group in coordinator.managers:
            for request_id, (column, source) in getattr(group, "partial_hit", {}).items():
                held = group.req_to_blocks.get(request_id, [])
                if not 0 <= column < len(held) or held[column] is not source or source.is_null:
                    return (f"MPART-2: request {request_id!r} group {group.group_id}: partial hit "
                            f"({column}, {source.block_id}) is not a real block it holds there")
        return None
