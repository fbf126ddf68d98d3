"""EAGLE per KV-cache group, optimized side (spec/coordinators.md section 4.1).

The same rules as the reference, from the shared vocabulary
(:mod:`pagedkv.optimized.rules.eagle_rules`): :func:`apply_eagle_groups` sets each manager's
``use_eagle`` (its own hit rule) and ``replay_eagle`` (whether the model
drafts: the replay positions retention keeps). The Mamba sparse-retention
mask is :func:`pagedkv.optimized.groups.mamba_publish.retention_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.optimized.rules.eagle_rules import eagle_group_mask
from pagedkv.spec.config import KVCacheGroupSpec
from pagedkv.spec.registry import manager_kind_for

__all__ = ["apply_eagle_groups", "replay_positions"]


def apply_eagle_groups(managers: Sequence[SingleTypeManager], groups: Sequence[KVCacheGroupSpec],
                       block_sizes: Sequence[int], use_eagle: bool) -> None:
    """Set every manager's EAGLE flags (D-SWA-14). Cost: O(groups)."""
    keys = [(manager_kind_for(group.kv_cache_spec), group.kv_cache_spec, size)
            for group, size in zip(groups, block_sizes)]
    flags = eagle_group_mask([group.is_eagle_group for group in groups], keys, use_eagle)
    for manager, flag in zip(managers, flags):
        manager.use_eagle = flag and manager.uses_eagle_rule
        manager.replay_eagle = use_eagle


def replay_positions(num_prompt_tokens: object, alignment: int, eagle: bool) -> list[int]:
    """The prompt's replay positions (spec/managers.md section 4): ``P - 1``;
    with a drafter one alignment unit below the resend's and a longer
    sibling's aligned ends. None for a missing or empty prompt. Cost: O(1)."""
    if not isinstance(num_prompt_tokens, int) or num_prompt_tokens < 1:
        return []
    if not eagle:
        return [num_prompt_tokens - 1]
    resend = (num_prompt_tokens - 1) // alignment * alignment - alignment
    extension = num_prompt_tokens // alignment * alignment - alignment
    return [resend if resend > 0 else 0, extension if extension > 0 else 0]
