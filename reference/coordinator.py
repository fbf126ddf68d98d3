"""The coordinator (spec/coordinators.md): the block pool, one single-type
manager per group, the known requests and one instance of each feature
(spec/managers.md §9). The hybrid hit is the brute-force definition itself
(LOOKUP-3, HYB-1): the largest aligned ``L <= max_length`` at which every
group serves a hit by its own rule; ``L = 0`` always qualifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.cross_attention import CrossAttentionManager
from pagedkv.reference.hooks import Feature
from pagedkv.reference.mamba import MambaManager
from pagedkv.reference.single_type import FullAttentionManager, SingleTypeManager, SinkFullAttentionManager
from pagedkv.reference.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.request import RequestFacts
from pagedkv.spec.types import BlockHash

__all__ = ["KVCacheCoordinator", "MANAGER_FOR_KIND", "group_view"]

F = TypeVar("F", bound=Feature)
Hits = Sequence[Sequence[KVCacheBlock]]
"""A hit's blocks per group, as ``get_computed_blocks`` hands them."""

MANAGER_FOR_KIND: dict[str, type[SingleTypeManager]] = {
    "full_attention": FullAttentionManager, "sink_full_attention": SinkFullAttentionManager,
    "sliding_window": SlidingWindowManager, "chunked_local": ChunkedLocalAttentionManager,
    "mamba": MambaManager, "cross_attention": CrossAttentionManager}
"""The kernel's manager for each seed kind; features add theirs (H1)."""


def group_view(block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int) -> list[BlockHash]:
    """A request's hashes at a group's block size (D-HASH-5)."""
    scale = block_size // hash_block_size
    if scale == 1:
        return list(block_hashes)
    return [BlockHash(b"".join(block_hashes[index * scale:(index + 1) * scale]))
            for index in range(len(block_hashes) // scale)]


class KVCacheCoordinator:
    """Prefix caching over any number of groups of any attention types;
    never a hit without caching or a cacheable group. ``max_model_len`` and
    ``max_num_batched_tokens`` give the windowed groups' admission caps."""

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool, block_sizes: Sequence[int],
                 hash_block_size: int, enable_caching: bool, use_eagle: bool, retention_interval: int | None,
                 max_model_len: int, max_num_batched_tokens: int, features: Sequence[type[Feature]] = ()) -> None:
        groups = self.kv_cache_groups = kv_cache_config.kv_cache_groups
        self.block_pool, self.block_sizes, self.hash_block_size = block_pool, list(block_sizes), hash_block_size
        self.enable_caching, self.use_eagle = enable_caching, use_eagle
        self.features = tuple(make() for make in features)
        manager_types = dict(MANAGER_FOR_KIND)
        for feature in self.features:  # H1: the features' kinds, none served twice
            for kind, manager_type in feature.attention_types().items():
                assert kind not in manager_types, f"manager kind {kind!r} is served twice"
                manager_types[kind] = manager_type
        # Groups outside prefix caching neither hit nor cache nor bound the alignment (PFX-1).
        self.cacheable = [prefix_cacheable(group.kv_cache_spec) for group in groups]
        self.caching = enable_caching and any(self.cacheable)
        self.alignment = rules.hit_alignment([size for size, ok in zip(self.block_sizes, self.cacheable) if ok])
        # The step of the hit search and of hybrid caching; sub-block hits refine it (MPART-1).
        self.hit_unit = self.alignment
        self.partial_hits_enabled = False  # set by the sub-block-hits feature
        self.managers: list[SingleTypeManager] = []
        for group_id, (group, block_size) in enumerate(zip(groups, block_sizes)):
            spec, kind = group.kv_cache_spec, manager_kind_for(group.kv_cache_spec)
            if kind not in manager_types:
                raise InvalidConfigError(f"kv_cache_groups[{group_id}]: manager kind {kind!r} has no reference manager")
            # The per-request cap startup sizing counts (CFG-7, CFG-8).
            cap = (spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
                   if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) else None)
            self.managers.append(manager_types[kind](
                spec, block_pool=block_pool, group_id=group_id, block_size=block_size, enable_caching=enable_caching,
                alignment=self.alignment, use_eagle=use_eagle, retention_interval=retention_interval,
                admission_cap=cap))
        self.known: set[str] = set()
        # Tokens a multi-module drafter re-prefills, never cached (D-HASH-12); the facade sets it.
        self.num_reprefillable_tokens = 0
        for feature in self.features:  # H2
            feature.configure(self)

    def feature(self, kind: type[F]) -> F:
        """This coordinator's instance of the feature class ``kind``."""
        return next(feature for feature in self.features if isinstance(feature, kind))

    def view(self, manager: SingleTypeManager, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """``block_hashes`` at ``manager``'s block size."""
        return group_view(block_hashes, self.hash_block_size, manager.block_size)

    def lookup(self, manager: SingleTypeManager, block_hashes: Sequence[BlockHash],
               max_length: int) -> tuple[Sequence[BlockHash], int]:
        """The hashes ``manager``'s lookups read and their cap: its view and ``max_length``, or a feature's (H3)."""
        for feature in self.features:
            found = feature.lookup(self, manager, block_hashes, max_length)
            if found is not None:
                return found
        return self.view(manager, block_hashes), max_length

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Hit blocks per group and the hit length: LOOKUP-3 by brute force,
        the definition HYB-1's maximality is checked against. A group outside
        prefix caching serves every length with no block (PFX-1)."""
        if not self.caching:
            return tuple([] for _ in self.managers), 0
        lookups = [self.lookup(manager, block_hashes, max_length) if cacheable else ([], 0)
                   for manager, cacheable in zip(self.managers, self.cacheable)]
        groups = list(zip(self.managers, lookups, self.cacheable))
        length = max_length // self.hit_unit * self.hit_unit
        while length > 0 and not all(not cacheable or manager.can_hit(view, length, limit)
                                     for manager, (view, limit), cacheable in groups):
            length -= self.hit_unit
        return tuple(manager.hit_blocks(view, length, limit) if cacheable else []  # LOOKUP-4
                     for manager, (view, limit), cacheable in groups), length

    def _tokens(self, manager: SingleTypeManager, num_tokens: int, num_encoder_tokens: int) -> int:
        """Cross-attention groups are sized by the encoder tokens (XATTN-1)."""
        return num_encoder_tokens if isinstance(manager, CrossAttentionManager) else num_tokens

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, hits: Hits, num_total_computed_tokens: int,
                                   num_main_tokens: int, num_encoder_tokens: int,
                                   num_external_computed_tokens: int = 0) -> int:
        """ALLOC-5: free blocks every group consumes in this allocation."""
        return sum(manager.get_num_blocks_to_allocate(
            request_id, self._tokens(manager, num_tokens, num_encoder_tokens), group_hits, num_total_computed_tokens,
            self._tokens(manager, num_main_tokens, num_encoder_tokens), num_external_computed_tokens)
            for manager, group_hits in zip(self.managers, hits))

    def step_blocks(self, request: RequestFacts, request_id: str, query_start: int, query_end: int,
                    reserve: bool) -> int:
        """Blocks the features add to the step ``[query_start, query_end)`` (H5)."""
        return sum(feature.step_blocks(self, request, request_id, query_start, query_end, reserve)
                   for feature in self.features)

    def full_sequence_demand(self, request_id: str, num_tokens: int, hits: Hits, num_encoder_tokens: int) -> int:
        """Free blocks the whole request needs beyond what it holds or hits (§8)."""
        demand = 0
        for manager, group_hits in zip(self.managers, hits):
            required = manager.admission_blocks(self._tokens(manager, num_tokens, num_encoder_tokens))
            demand += max(required - manager.covered_blocks(request_id, group_hits), 0)
            if request_id not in manager.req_to_blocks:
                demand += sum(1 for block in group_hits if block.ref_cnt == 0 and not block.is_null)
        return demand

    def admit(self, request_id: str, hits: Hits, num_local_computed_tokens: int,
              num_external_computed_tokens: int) -> None:
        """ALLOC-6: ``request_id`` becomes known; every group takes its hit before any allocates (D-API-9)."""
        self.known.add(request_id)
        for manager, group_hits in zip(self.managers, hits):
            manager.admit(request_id, group_hits, num_local_computed_tokens, num_external_computed_tokens)
        for manager in self.managers:
            manager.allocate_external(request_id, num_local_computed_tokens + num_external_computed_tokens,
                                      num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int,
                            num_encoder_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """ALLOC-7: fresh blocks per group so the tokens have slots."""
        return tuple(manager.allocate_new_blocks(
            request_id, self._tokens(manager, num_tokens, num_encoder_tokens),
            self._tokens(manager, num_main_tokens, num_encoder_tokens)) for manager in self.managers)

    def cache_blocks(self, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Cache every group's full blocks, as far as the request has hashes (D-API-11)."""
        hashed = len(request.block_hashes) * self.hash_block_size
        # A multi-module drafter's re-prefilled tokens are not final
        # (D-HASH-12): one group never caches them; several only keep them
        # out of an EAGLE group's extra block, as vLLM 0.33 does.
        finalized = min(max(0, num_tokens - self.num_reprefillable_tokens), hashed)
        num_tokens = finalized if len(self.managers) == 1 else min(num_tokens, hashed)
        # Several groups cache whole units only; an EAGLE group also the block after (D-HIT-5, D-MAMBA-36).
        unit = self.hit_unit
        aligned = num_tokens // unit * unit if len(self.managers) > 1 else num_tokens
        for feature in self.features:  # H6
            feature.caching(self, request_id, num_tokens)
        for manager, cacheable in zip(self.managers, self.cacheable):
            if cacheable:
                tokens = min(finalized, finalized // unit * unit + manager.block_size) if (
                    manager.use_eagle and aligned > 0) else aligned
                manager.cache_blocks(request, self.view(manager, request.block_hashes), request_id, tokens)

    def release(self, request_id: str) -> None:
        """FREE-2, FREE-6: every group releases the request's blocks, group by group."""
        self.known.remove(request_id)
        for manager in self.managers:
            manager.release(request_id)
