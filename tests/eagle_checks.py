"""Post-condition of Mamba sparse retention (spec/mamba.md MRET-1), for the
lockstep machines: after an allocation, every Mamba state block the call
newly keyed under the request's own full-block key is one the retention
mask marks. Public API only (``kv_cache_config``, ``block_sizes``,
``hash_block_size``, ``get_block_ids``, ``snapshot``) plus the options the
manager was built with."""

from __future__ import annotations

import math
from typing import Any

from pagedkv.reference.features.mamba_checkpoint_rules import (
    mamba_kept_boundaries,
    mamba_retention_mask,
    partial_hash_hits_configured,
)
from pagedkv.reference.features.mamba_partial_rules import resume_position
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.errors import InvariantViolation
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.request import Request
from pagedkv.spec.snapshot import ManagerSnapshot
from pagedkv.spec.types import BlockHash, make_block_hash_with_group_id
from tests.postconditions import group_view

__all__ = ["check_mamba_retention"]


def check_mamba_retention(manager: Any, request: Request, before: ManagerSnapshot,
                          options: dict[str, Any]) -> None:
    """MRET-1 for ``request`` after a call that started from ``before``."""
    retention = options.get("retention_interval")
    hash_block_size = manager.hash_block_size
    if retention is None or hash_block_size is None:
        return
    groups = manager.kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    sizes = list(manager.block_sizes)
    alignment = math.lcm(*(size for size, spec in zip(sizes, specs) if prefix_cacheable(spec)))
    # The hash block when vLLM's MCKPT-4 holds at construction or the switch
    # went on (DCP widens the condition only through the switch, which a
    # machine may see refused, e.g. the resume checkpoint without EAGLE).
    kinds = [manager_kind_for(spec) for spec in specs]
    fine = (bool(getattr(manager.coordinator, "partial_hits_enabled", False))
            or partial_hash_hits_configured(kinds, specs, sizes, hash_block_size))
    unit = hash_block_size if fine else alignment
    junction = getattr(request, "shared_prefix_boundary", 0)
    kept = mamba_kept_boundaries(request.num_prompt_tokens, junction, alignment, bool(options.get("use_eagle")))
    after = manager.snapshot().pool.block_hashes
    for group_id, (spec, size) in enumerate(zip(specs, sizes)):
        if not isinstance(spec, MambaSpec):
            continue
        view = group_view(request.block_hashes, hash_block_size, size)
        for index, block in enumerate(manager.get_block_ids(request.request_id)[group_id]):
            if not block or before.pool.block_hashes[block] is not None or index >= len(view):
                continue
            if after[block] != make_block_hash_with_group_id(BlockHash(view[index]), group_id):
                continue
            group = manager.coordinator.managers[group_id]
            checkpoint = getattr(group, "checkpoints", {}).get(request.request_id)
            if checkpoint is not None and checkpoint[1] == index:
                continue  # a checkpoint block is published by MCKPT-5, not by the mask
            if getattr(group, "sub_block_hits", False) and resume_position(
                    (index + 1) * size, num_prompt_tokens=request.num_prompt_tokens,
                    hash_block_size=hash_block_size, drop_eagle_block=group.drop_eagle_checkpoint,
                    num_hash_lookahead_tokens=group.hash_lookahead_tokens(),
                    shared_prefix_checkpoint=group.shared_prefix_checkpoint, shared_prefix_boundary=junction,
                    num_computed_tokens=0):  # lenient: any junction inside the prompt
                continue  # a resume state at a block end is published by MPART-5, not by the mask
            mask = mamba_retention_mask(index, index + 1, size, unit, retention, kept)
            if mask is not None and not mask[0]:
                raise InvariantViolation(
                    f"MRET-1: group {group_id} keyed state block {block} at position {index} under "
                    f"retention {retention} (kept boundaries {kept}, alignment {unit})")
