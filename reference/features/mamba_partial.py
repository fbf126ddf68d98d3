"""Sub-block (partial) prefix hits for Mamba ``align`` groups and the
copy-on-write they need (spec/mamba.md, "Sub-block hits", MPART-1..4).

Brute force on purpose: keys are placed and moved by editing the pool's
dict directly, one block at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features.mamba_partial_rules import hit_fits
from pagedkv.reference.hooks import Feature
from pagedkv.spec.types import BlockHash, BlockHashWithGroupId, make_block_hash_with_group_id

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator
    from pagedkv.reference.single_type import SingleTypeManager

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
    """With sub-block hits on, a group that hits inside its blocks takes a
    hit of whole hash blocks and the block holding the last of them (H4, MPART-1)."""

    def accepts_hit(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager, num_tokens: int,
                    num_blocks: int, num_external_computed_tokens: int) -> bool:
        return bool(getattr(manager, "partial_hits", False)) and hit_fits(
            num_tokens, num_blocks, manager.block_size, coordinator.hash_block_size, True)
