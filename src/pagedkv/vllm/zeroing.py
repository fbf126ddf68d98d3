"""Worker-side KV cache zeroing (vLLM 0.33's ``take_new_block_ids``,
D-API-41): the ids of blocks a step newly handed out, which the worker
zeroes before use.

vLLM zeroes when the model has Mamba layers or mixed-precision KV caches
(``KVCacheConfig.needs_kv_cache_zeroing``), and then only the blocks of
attention groups (Mamba state and compressor rings are rewritten whole).
Blocks an asynchronous KV load fills are left out for the groups the load
restores (``skip_zeroing_group_ids``): zeroing them would race the load.

The core keeps no such list: this recorder reads each group's block list
before and after ``allocate_slots`` and records the fresh real blocks, which
is the same set vLLM's managers record as they allocate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.optimized.engine import NULL_BLOCK

from . import _compat

__all__ = ["ZeroingRecorder"]


class ZeroingRecorder:
    """The pending block ids to zero, for one manager."""

    def __init__(self, kv_cache_config: Any, block_sizes: Sequence[int]) -> None:
        classes = _compat.spec_classes()
        attention = classes.get("AttentionSpec")
        ring = classes.get("CircularBufferSpec")
        enabled = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
        self.groups: tuple[int, ...] = tuple(
            group_id for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
            if enabled and attention is not None and isinstance(group.kv_cache_spec, attention)
            and not (ring is not None and isinstance(group.kv_cache_spec, ring)))
        """The groups whose new blocks are zeroed (none when zeroing is off)."""
        self.block_sizes = tuple(block_sizes)
        self.pending: list[int] = []

    def held_lengths(self, held: tuple[list[int], ...] | None) -> tuple[int, ...]:
        """Each recorded group's list length before an allocation (0 for a new request)."""
        return tuple(0 if held is None else len(held[group_id]) for group_id in self.groups)

    def record_allocation(self, before: tuple[int, ...], after: tuple[list[int], ...],
                          hit: Sequence[Sequence[int]] | None, *, num_loaded_tokens: int,
                          skip_group_ids: Sequence[int]) -> None:
        """Record the real blocks appended since ``before``, the hit's excepted.
        In a group listed in ``skip_group_ids``, blocks at positions below
        ``num_loaded_tokens`` (the computed tokens, local and loaded) are the
        load's to write and are left out."""
        for index, group_id in enumerate(self.groups):
            hit_ids = set(hit[group_id]) if hit is not None else set()
            first_recorded = before[index]
            if group_id in skip_group_ids:
                block_size = self.block_sizes[group_id]
                first_recorded = max(first_recorded, -(-num_loaded_tokens // block_size))
            self.pending.extend(block for block in after[group_id][first_recorded:]
                                if block != NULL_BLOCK and block not in hit_ids)

    def record_from(self, held: tuple[list[int], ...], start_token: int) -> None:
        """Re-record a request's blocks from ``start_token`` on (a failed load
        left them unwritten). ``start_token`` must be block-aligned in every
        recorded group: zeroing a partly valid block would wipe its prefix."""
        for group_id in self.groups:
            block_size = self.block_sizes[group_id]
            if start_token % block_size:
                raise ValueError(f"start_token ({start_token}) is not a multiple of group "
                                 f"{group_id}'s block size ({block_size})")
            self.pending.extend(held[group_id][start_token // block_size:])

    def take(self) -> list[int]:
        """The ids recorded since the last call, then forget them."""
        taken, self.pending = self.pending, []
        return taken
