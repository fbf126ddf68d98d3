"""What sub-block hits add to a coordinator: checking a hit handed back to
``allocate_slots`` (a state block may carry any boundary's key inside it,
MPART-1; a tail may be served through its extra entry, D-MAMBA-22), and
the copy-on-write pairs with the retention references that keep their
blocks alive until the copy ran (MPART-3). A mixin of
:class:`pagedkv.optimized.coordination.coordinator.KVCacheCoordinator`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedkv.optimized.groups.dcp_partial import FullAttentionSubBlockManager
from pagedkv.optimized.groups.hybrid_search import HashViews
from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.rules.mamba_partial_rules import state_keys_in_block
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.types import BlockHash

__all__ = ["SubBlockCoordination"]


class SubBlockCoordination:
    """Mixin: needs the coordinator's pool, managers, sizes and retention
    counter (``KVCacheCoordinator.__init__`` sets them)."""

    block_pool: BlockPool
    managers: tuple[SingleTypeManager, ...]
    block_sizes: tuple[int, ...]
    hash_block_size: int
    copy_managers: tuple[MambaManager | FullAttentionSubBlockManager, ...]
    retained: Counter[int]

    def stale_hit(self, block_hashes: Sequence[BlockHash],
                  new_computed_blocks: Sequence[Sequence[int]]) -> str | None:
        """Why a hit handed back to ``allocate_slots`` no longer holds, or
        ``None``: block ``i`` of group ``g`` (null blocks aside) must carry
        group ``g``'s view of ``block_hashes`` at ``i``. A block evicted or
        reused since ``get_computed_blocks`` would hand the request another
        prefix's KV (D-API-8). Ids must lie in the pool (checked before).

        Cost: O(hit blocks) (plus the views of groups hashed at a larger size).
        """
        pool = self.block_pool
        hashes, group_ids = pool.block_hashes, pool.block_group_ids
        views = HashViews(block_hashes, self.hash_block_size)  # the keys' views, not the lookup's
        for group_id, group in enumerate(new_computed_blocks):
            if not group:
                continue
            view = views.at(self.block_sizes[group_id])
            if 0 not in group and len(group) <= len(view):
                # The rule (no null block): two gathers and a list comparison
                # run per block in C; only a mismatch takes the loop below,
                # which names the first bad position.
                expected = view[:len(group)]
                if (list(map(hashes.__getitem__, group)) == (
                        expected if type(expected) is list else list(expected))
                        and list(map(group_ids.__getitem__, group)).count(group_id) == len(group)):
                    continue
            manager = self.managers[group_id]
            fine = isinstance(manager, (MambaManager, FullAttentionSubBlockManager)) and manager.partial_hits
            hash_size = self.hash_block_size
            for index, block in enumerate(group):
                if not block:
                    continue
                if fine and group_ids[block] == group_id and hashes[block] in state_keys_in_block(
                        block_hashes, index, hash_size, manager.block_size):
                    continue  # a state block may carry any boundary's key inside it (MPART-1)
                if isinstance(manager, FullAttentionSubBlockManager) and manager.extra_entry_serves(
                        block_hashes, index, block):
                    continue  # a tail served through its extra entry (D-MAMBA-22)
                if (index >= len(view) or hashes[block] != view[index]
                        or group_ids[block] != group_id):
                    return (f"group {group_id} position {index}: block {block} no longer caches "
                            "that position (evicted or reused since get_computed_blocks)")
        return None

    def take_block_copies(self, *, hand_over: bool = False) -> list[tuple[int, int]]:
        """Every Mamba group's queued copy-on-write pairs, groups in id order
        (MPART-3); their retention references pass to the caller.
        Cost: O(groups + copies)."""
        pairs = [pair for manager in self.copy_managers for pair in manager.take_copies()]
        if pairs and not hand_over:  # handed over: plain pool references (D-MAMBA-19)
            self.retained.update(block for pair in pairs for block in pair)
        return pairs

    def release_copy_retentions(self, block_ids: Sequence[int]) -> None:
        """Drop one retention reference per id, in order (MPART-3).

        Raises:
            InvalidArgumentError: an id not retained that many times (no change).
        Cost: O(len(block_ids)).
        """
        wanted = Counter(block_ids)
        for block, times in wanted.items():
            if self.retained[block] < times:
                raise InvalidArgumentError(
                    f"block_ids: block {block!r} is released {times} time(s) but retained "
                    f"{self.retained[block]} time(s) by taken copies")
        self.retained.subtract(wanted)
        self.retained = +self.retained
        self.block_pool.free_blocks(block_ids)
