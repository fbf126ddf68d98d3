"""EAGLE per KV-cache group and Mamba sparse retention, reference side
(spec/coordinators.md section 4.1, spec/mamba.md "Sparse retention").

The coordinator calls :func:`apply_eagle_groups` once its managers are
built: each manager learns whether the EAGLE hit rule applies to it
(``use_eagle``) and whether the model drafts at all (``replay_eagle``: the
replay positions sparse retention keeps, and the Mamba checkpoint shift,
are the model's, not the group's). :func:`mamba_retention_cache_mask` is
the Mamba group's sparse-retention mask.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference import rules
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.config import KVCacheGroupSpec
from pagedkv.spec.eagle import eagle_group_mask, mamba_kept_boundaries, mamba_retention_mask
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.registry import manager_kind_for

__all__ = ["apply_eagle_groups", "mamba_retention_cache_mask"]


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


def mamba_retention_cache_mask(manager: SingleTypeManager, request: HashedRequest, num_cached: int,
                               num_full: int, alignment: int) -> list[bool] | None:
    """The Mamba state blocks in ``[num_cached, num_full)`` sparse retention
    publishes (D-MAMBA-35): segment ends and the states at the prompt's
    replay positions and the pinned shared-prefix junction, each floored to
    ``alignment`` (the hit alignment)."""
    if manager.retention_interval is None:
        return None
    prompt = getattr(request, "num_prompt_tokens", None)
    replay = (rules.replay_boundaries(prompt, manager.alignment, manager.replay_eagle)
              if isinstance(prompt, int) else ())
    junction = getattr(request, "shared_prefix_boundary", 0)
    boundaries = mamba_kept_boundaries(replay, junction if isinstance(junction, int) else 0)
    return mamba_retention_mask(num_cached, num_full, manager.block_size, alignment,
                                manager.retention_interval, boundaries)
