"""EAGLE per KV-cache group, reference side (spec/coordinators.md section 4.1).

:class:`Eagle` calls :func:`apply_eagle_groups` once the managers are
built (H2): each manager learns whether the EAGLE hit rule applies to it
(``use_eagle``) and whether the model drafts at all (``replay_eagle``: the
replay positions sparse retention keeps, and the Mamba checkpoint shift,
are the model's, not the group's). The Mamba sparse-retention mask is
:func:`pagedkv.reference.features.mamba_publish.retention_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.reference.features.eagle_rules import eagle_group_mask, eagle_peek_limit
from pagedkv.reference.hooks import Feature
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.config import KVCacheGroupSpec
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["Eagle", "apply_eagle_groups"]


def apply_eagle_groups(managers: Sequence[SingleTypeManager], groups: Sequence[KVCacheGroupSpec],
                       block_sizes: Sequence[int], use_eagle: bool) -> None:
    """Set every manager's EAGLE flags (D-SWA-14): the rule applies to the
    marked groups and their same-spec siblings (all groups when none is
    marked), never to a type exempt from it (Mamba, cross-attention)."""
    keys = [(manager_kind_for(group.kv_cache_spec), group.kv_cache_spec, size)
            for group, size in zip(groups, block_sizes)]
    flags = eagle_group_mask([group.is_eagle_group for group in groups], keys, use_eagle)
    for manager, flag in zip(managers, flags):
        manager.use_eagle = flag and manager.uses_eagle_rule
        manager.replay_eagle = use_eagle


class Eagle(Feature):
    """EAGLE per group (H2): marked groups and their same-spec siblings
    (D-SWA-14); with several groups an EAGLE group's given-back block may
    reach past the hit cap (H3, D-SWA-15)."""

    def configure(self, coordinator: KVCacheCoordinator) -> None:
        apply_eagle_groups(coordinator.managers, coordinator.kv_cache_groups, coordinator.block_sizes,
                           coordinator.use_eagle)

    def lookup(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager,
               block_hashes: Sequence[BlockHash], max_length: int) -> tuple[Sequence[BlockHash], int] | None:
        if not manager.use_eagle:
            return None
        hashed = len(block_hashes) * coordinator.hash_block_size
        return coordinator.view(manager, block_hashes), eagle_peek_limit(max_length, hashed, len(coordinator.managers))
