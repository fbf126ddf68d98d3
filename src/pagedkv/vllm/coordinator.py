"""vLLM's ``manager.coordinator`` and its ``single_type_managers``, as views.

vLLM's scheduler reads a few coordinator attributes directly (each group's
``block_size`` and ``kv_cache_spec``, ``enable_partial_hash_hits``,
``get_num_blocks_to_allocate`` for its admission arithmetic), and vLLM's
tests read per-request tables (``req_to_blocks``, ``num_cached_block``).
These classes answer from pagedkv's coordinator; they change nothing.

This module and :mod:`pagedkv.vllm.manager` are the only places that read
pagedkv's coordinator below the facade (``managers``, ``req_to_blocks``,
``num_cached_blocks``, ``get_num_blocks_to_allocate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pagedkv.optimized.engine import FullAttentionManager, KVCacheCoordinator
from pagedkv.spec.errors import InvalidConfigError

from . import _compat
from .blocks import BlockPoolView, BlockView
from .group_views import GroupManagerView, ZeroingBlockIds
from .mamba import CoreMambaManager, MambaManagerView

__all__ = ["CoordinatorView", "GroupManagerView", "ZeroingBlockIds", "make_coordinator_view"]


class SpecGroup(NamedTuple):
    """One entry of vLLM's ``attention_groups``: groups of one spec searched together."""

    spec: Any
    group_ids: list[int]
    manager_cls: type
    use_eagle: bool


class CoordinatorView:
    """vLLM's ``KVCacheCoordinator`` attributes over pagedkv's coordinator.

    Build it with :func:`make_coordinator_view`, which makes it an instance of
    the coordinator class vLLM would have built (vLLM's connectors check it).
    """

    def __init__(self, core: KVCacheCoordinator, vllm_config: Any, pool: BlockPoolView,
                 retention_interval: int | None, dcp_world_size: int = 1) -> None:
        self.core = core
        self.block_pool = pool
        self.kv_cache_config = vllm_config
        self.single_type_managers: tuple[GroupManagerView, ...] = tuple(
            _compat.posing_as(
                MambaManagerView if isinstance(manager, CoreMambaManager) else GroupManagerView,
                _compat.vllm_manager_class(group))(
                manager, group.kv_cache_spec, group_id, pool, dcp_world_size)
            for group_id, (manager, group) in enumerate(
                zip(core.managers, vllm_config.kv_cache_groups)))
        # Each group's block size in tokens, as vLLM 0.33 scales it (D-VLLM-7).
        self.group_block_sizes: tuple[int, ...] = tuple(
            manager.block_size for manager in self.single_type_managers)
        # Sub-block hits: on where vLLM would and the core supports them
        # (D-MAMBA-14, D-MAMBA-15); EAGLE sibling groups are not in pagedkv yet.
        self.enable_partial_hash_hits = bool(getattr(core, "partial_hits_enabled", False))
        self.eagle_group_ids: tuple[int, ...] = ()
        self.num_reprefillable_tokens = 0
        self._retention_interval = retention_interval
        # The scheduler's block (vLLM's retention and replay unit); the adapter sets it.
        self.scheduler_block_size: int = core.alignment
        # The dense reference group of per-group lookups: the first
        # full-attention group of a hybrid with caching on, else None.
        self.full_attention_group_id: int | None = next(
            (group_id for group_id, manager in enumerate(core.managers)
             if isinstance(manager, FullAttentionManager)),
            None) if len(core.managers) > 1 and core.enable_caching else None

    @property
    def attention_groups(self) -> list[SpecGroup]:
        """vLLM's hit-search grouping, for inspection: the prefix-cacheable
        groups (PFX-1) gathered by equal spec and manager class, full
        attention first. pagedkv's search does not use it."""
        found: list[SpecGroup] = []
        for group_id, (manager, group) in enumerate(zip(self.single_type_managers,
                                                        self.kv_cache_config.kv_cache_groups)):
            if not getattr(group.kv_cache_spec, "prefix_cacheable", True):
                continue
            for spec_group in found:
                if spec_group.spec == group.kv_cache_spec and spec_group.manager_cls is type(manager):
                    spec_group.group_ids.append(group_id)
                    break
            else:
                found.append(SpecGroup(group.kv_cache_spec, [group_id], type(manager), False))
        full = _compat.spec_classes().get("FullAttentionSpec")
        found.sort(key=lambda spec_group: not (full is not None and isinstance(spec_group.spec, full)))
        return found

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """Where hits land: the hash block with sub-block hits, else the
        scheduler's block (vLLM's resolved alignment, MCKPT-4)."""
        if self.enable_partial_hash_hits:
            return int(self.core.hash_block_size)
        return self.scheduler_block_size

    @property
    def hash_block_size(self) -> int:
        """The granularity of the requests' block hashes (vLLM's coordinator attribute)."""
        return int(self.core.hash_block_size)

    @property
    def retention_interval(self) -> int | None:
        return self._retention_interval

    @retention_interval.setter
    def retention_interval(self, value: int | None) -> None:
        # vLLM's tests set it after construction; the core's sliding-window
        # managers read it when they cache, so it takes effect from then on.
        if value is not None and (type(value) is not int or value < 0
                                  or value % self.core.alignment):
            raise InvalidConfigError(
                f"retention_interval must be None, 0 or a positive multiple of "
                f"{self.core.alignment}, got {value!r}")
        self._retention_interval = value
        for manager in self.core.managers:
            manager.retention_interval = value

    def find_longest_cache_hit_per_group(
            self, block_hashes: Sequence[Any],
            max_cache_hit_length: int) -> tuple[tuple[list[BlockView], ...], tuple[int, ...]]:
        """Each group's own hit (vLLM's per-group lookup for connectors)."""
        hits, lengths = self.core.find_longest_cache_hit_per_group(block_hashes, max_cache_hit_length)
        return tuple(self.block_pool.views(group) for group in hits), lengths

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[Sequence[Any]],
        num_encoder_tokens: int, total_computed_tokens: int, num_local_computed_tokens: int = 0,
        num_tokens_main_model: int | None = None, apply_admission_cap: bool = False,
        prefill_end: int | None = None,
    ) -> int:
        """Free blocks an allocation of ``num_tokens`` would take (vLLM's keywords)."""
        hits = tuple([block.block_id for block in group] for group in new_computed_blocks)
        return self.core.get_num_blocks_to_allocate(
            request_id=request_id, num_tokens=num_tokens,
            new_computed_blocks=hits if any(hits) else None,
            num_total_computed_tokens=total_computed_tokens,
            num_main_tokens=num_tokens if num_tokens_main_model is None else num_tokens_main_model,
            num_encoder_tokens=num_encoder_tokens,
            num_external_computed_tokens=(total_computed_tokens - num_local_computed_tokens
                                          if num_local_computed_tokens else 0))


def make_coordinator_view(core: KVCacheCoordinator, vllm_config: Any, pool: BlockPoolView,
                          retention_interval: int | None, enable_caching: bool,
                          dcp_world_size: int = 1) -> CoordinatorView:
    """The coordinator view, posing as vLLM's class for this configuration."""
    view_class = _compat.posing_as(CoordinatorView, _compat.vllm_coordinator_class(
        enable_caching, len(vllm_config.kv_cache_groups)))
    view: CoordinatorView = view_class(core, vllm_config, pool, retention_interval, dcp_world_size)
    return view
