"""The lookups of ``pagedkv.vllm.KVCacheManager``: the prefix hit vLLM's
scheduler asks for a waiting request, the blocks and ids a request holds, the
cached prefix estimate and the truncation of a hit. Each answers from the core
(one-group shortcuts read the group's tables directly, D-PERF-13); a mixin of
the adapter's manager, as :mod:`step_drains` is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.optimized.engine import KVCacheManager as CoreManager

from . import _compat
from .blocks import BlockPoolView
from .requests import CappedRequest
from .truncate import truncated_groups

__all__ = ["Lookups"]

_VLLM_REQUEST: Any = _compat.VllmRequest


class Lookups:
    """Mixin: needs the adapter's core manager, its coordinator and the views
    over them, and the one-group tables (``KVCacheManager.__init__`` sets them)."""

    _core: CoreManager
    _core_coordinator: Any
    _unitary_lookup: Any
    _unitary_block_size: int
    _single_blocks_of: dict[str, list[int]] | None
    _cached_token_groups: tuple[tuple[Any, int], ...]
    enable_caching: bool
    empty_kv_cache_blocks: Any
    block_pool: BlockPoolView
    coordinator: Any
    kv_cache_config: Any
    num_kv_cache_groups: int
    # The manager's translation methods.
    _request: Callable[[Any], Any]
    _vllm_blocks: Callable[[Any], Any]
    create_kv_cache_blocks: Callable[[Any], Any]
    prefix_cache_lookup_enabled: Callable[[Any], bool]

    def get_computed_blocks(self, request: Any,
                            max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """The prefix hit: blocks, tokens and the shared-prefix boundary (the
        leading group's own hit when a sparser group lags it, else 0)."""
        lookup = self._unitary_lookup
        if lookup is not None and type(request) is _VLLM_REQUEST and max_cache_hit_length is None:
            # What the general path below does for this case (D-PERF-13): the one group's
            # lookup, read from vLLM's own Request as the view reads it; no boundary with
            # one group; the core keeps no stats (this layer does, record_prefix_cache_stats).
            if not self.enable_caching or request.skip_reading_prefix_cache:
                return self.empty_kv_cache_blocks, 0, 0
            hit = lookup(request.block_hashes, request.num_tokens - 1)
            if not hit:
                return self.empty_kv_cache_blocks, 0, 0
            return (_compat.KVCacheBlocks((list(map(self.block_pool.blocks.__getitem__, hit)),)),
                    len(hit) * self._unitary_block_size, 0)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        view: Any = (self._request(request) if max_cache_hit_length is None
                     else CappedRequest(request, max_cache_hit_length))
        blocks, num_hit_tokens = self._core.get_computed_blocks(view)
        boundary = (self._core.shared_prefix_boundary(view, num_hit_tokens)
                    if self.num_kv_cache_groups > 1 else 0)
        return self._vllm_blocks(blocks), num_hit_tokens, boundary

    def get_computed_blocks_for_connector(
            self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int, bool]:
        """A Mamba hybrid with full attention reports the full-attention
        group's own hit (the connector supplies what lagging groups miss) and
        whether it ran deeper than another group; otherwise, or when another
        group hit deeper than full attention, the common hit."""
        full_group = self.coordinator.full_attention_group_id
        if (full_group is None or not self.prefix_cache_lookup_enabled(request)
                or not getattr(self.kv_cache_config, "has_mamba_layers", False)):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        view: Any = (self._request(request) if max_cache_hit_length is None
                     else CappedRequest(request, max_cache_hit_length))
        blocks, lengths = self._core.get_computed_blocks_per_group(view)
        num_local = lengths[full_group]
        if any(length > num_local for length in lengths):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        return self._vllm_blocks(blocks), num_local, 0, min(lengths) < num_local

    def get_blocks(self, request_id: str) -> Any:
        """The request's blocks; empty for a request holding none (as vLLM)."""
        blocks_of = self._single_blocks_of
        if blocks_of is not None:
            # One group: its list is the request's (a known request has one, D-PERF-13).
            ids = blocks_of.get(request_id)
            if not ids:
                return self.empty_kv_cache_blocks
            return _compat.KVCacheBlocks((list(map(self.block_pool.blocks.__getitem__, ids)),))
        if request_id not in self._core_coordinator.requests:
            return self.empty_kv_cache_blocks
        return self.create_kv_cache_blocks(self._core_coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self._core_coordinator.requests:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self._core.get_block_ids(request_id)

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        spec_classes = _compat.spec_classes()
        unclipped = tuple(spec_classes[name] for name in (
            "CrossAttentionSpec", "EncoderOnlyAttentionSpec") if name in spec_classes)
        clipped: list[list[int]] = []
        for group, ids in zip(self.kv_cache_config.kv_cache_groups, self.get_block_ids(request_id)):
            spec = group.kv_cache_spec
            if not isinstance(spec, spec_classes["AttentionSpec"]) or isinstance(spec, unclipped):
                clipped.append(ids)
            else:
                clipped.append(ids[:-(-num_computed_tokens // spec.block_size)])
        return tuple(clipped)

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's cached prefix: the least over the prefix-cacheable groups."""
        request_id = request.request_id
        if request_id not in self._core_coordinator.requests:
            return 0
        cached: int | None = None
        for manager, block_size in self._cached_token_groups:
            tokens = manager.num_cached_blocks[request_id] * block_size
            if cached is None or tokens < cached:
                cached = tokens
        return cached or 0

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        """The lookup result cut at ``num_computed_tokens`` (truncate.py, D-API-42)."""
        managers = self._core.coordinator.managers
        return self.create_kv_cache_blocks(truncated_groups(
            blocks.blocks, [manager.kv_cache_spec for manager in managers],
            [manager.block_size for manager in managers], num_computed_tokens))
