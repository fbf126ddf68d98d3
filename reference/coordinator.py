"""Coordinators: every KV cache group's manager, driven together
(spec/coordinators.md). A coordinator holds the manager's state: the block
pool (built by the facade and handed in, as in ``pagedkv.optimized``), one
single-type manager per group, and the known requests.

The hybrid coordinator's hit is the brute-force definition itself: the
largest length ``L <= max_length``, a multiple of the alignment (the LCM of
the groups' block sizes), at which every group can serve a hit by its own
rule; ``L = 0`` always qualifies. With one group this is the unitary
coordinator's hit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.cross_attention import CrossAttentionManager
from pagedkv.reference.features.dcp_partial import FullAttentionSubBlockManager
from pagedkv.reference.features.dcp_rules import check_dcp_world_size, partial_hits_configured_under_dcp
from pagedkv.reference.features.eagle_rules import eagle_peek_limit
from pagedkv.reference.features.mamba_partial_rules import (
    check_supported,
    partial_hits_supported,
    shared_prefix_checkpoint_supported,
    state_keys_in_block,
)
from pagedkv.reference.hooks import Feature, attention_types
from pagedkv.reference.mamba import MambaManager
from pagedkv.reference.single_type import FullAttentionManager, SingleTypeManager, SinkFullAttentionManager
from pagedkv.reference.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.types import BlockHash, make_block_hash_with_group_id

__all__ = ["KVCacheCoordinator", "HybridCoordinator", "NoPrefixCacheCoordinator", "make_coordinator",
           "MANAGER_FOR_KIND", "group_view"]

MANAGER_FOR_KIND: dict[str, type[SingleTypeManager]] = {
    "full_attention": FullAttentionManager,
    "sink_full_attention": SinkFullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalAttentionManager,
    "mamba": MambaManager,
    "cross_attention": CrossAttentionManager,
}
"""The kernel's manager for each seed manager kind of :mod:`pagedkv.spec.registry`;
features add theirs through hook H1 (:mod:`pagedkv.reference.hooks`)."""

SUB_BLOCK_MANAGERS = (MambaManager, FullAttentionSubBlockManager)
"""Managers that hit inside their blocks when sub-block hits are on (MPART, FPART)."""


def group_view(block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int) -> list[BlockHash]:
    """A request's hashes at a group's block size: each group block's hash is
    the concatenation of the hashes of the hash blocks it spans (D-HASH-5)."""
    scale = block_size // hash_block_size
    if scale == 1:
        return list(block_hashes)
    return [BlockHash(b"".join(block_hashes[index * scale:(index + 1) * scale]))
            for index in range(len(block_hashes) // scale)]


class KVCacheCoordinator:
    """The block pool, one single-type manager per group, and the set of
    known requests. The arguments are those of :func:`make_coordinator`."""

    def __init__(self, kv_cache_config: KVCacheConfig, *, block_pool: BlockPool,
                 block_sizes: Sequence[int], hash_block_size: int, enable_caching: bool,
                 use_eagle: bool, retention_interval: int | None, max_model_len: int,
                 max_num_batched_tokens: int, features: Sequence[Feature] = ()) -> None:
        groups = kv_cache_config.kv_cache_groups
        manager_types = attention_types(MANAGER_FOR_KIND, features)  # H1
        self.enable_caching = enable_caching
        self.block_pool = block_pool
        self.block_sizes = list(block_sizes)
        self.hash_block_size = hash_block_size
        # Groups outside prefix caching (bounded-replay windows) neither hit
        # nor cache nor bound the hit alignment (PFX-1, D-API-40).
        self.cacheable = [prefix_cacheable(group.kv_cache_spec) for group in groups]
        self.alignment = rules.hit_alignment(
            [size for size, cacheable in zip(self.block_sizes, self.cacheable) if cacheable])
        self.managers: list[SingleTypeManager] = []
        for group_id, (group, block_size) in enumerate(zip(groups, block_sizes)):
            kind = manager_kind_for(group.kv_cache_spec)
            manager_type = manager_types.get(kind)
            if manager_type is None:
                raise InvalidConfigError(
                    f"kv_cache_groups[{group_id}]: manager kind {kind!r} has no reference manager")
            spec = group.kv_cache_spec
            # The per-request cap startup sizing counts (spec CFG-7, CFG-8).
            cap = (spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
                   if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) else None)
            self.managers.append(manager_type(
                spec, block_pool=self.block_pool, group_id=group_id, block_size=block_size,
                enable_caching=enable_caching, alignment=self.alignment, use_eagle=use_eagle,
                retention_interval=retention_interval, admission_cap=cap))
        self.known: set[str] = set()
        self.kv_cache_groups = groups
        self.features = tuple(features)
        self._specs = [group.kv_cache_spec for group in groups]
        self.partial_hits_enabled = False
        self.use_eagle = use_eagle
        # Copy endpoints handed out by ``take_block_copies`` and not yet
        # released, with multiplicity: one retention reference each (MPART-3).
        self.retained: Counter[int] = Counter()
        # Tokens a multi-module drafter re-prefills (num_prefill_lookahead - 1),
        # never cached (D-HASH-12); the facade sets it.
        self.num_reprefillable_tokens = 0
        for feature in features:  # H2: per-group switches, before any request
            feature.configure(self)

    def view(self, manager: SingleTypeManager, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """``block_hashes`` at ``manager``'s block size."""
        return group_view(block_hashes, self.hash_block_size, manager.block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Hit blocks per group and the hit length (nothing without a prefix cache)."""
        raise NotImplementedError

    def find_longest_cache_hit_per_group(
            self, block_hashes: Sequence[BlockHash],
            max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each group's own longest hit, not reconciled across groups (what a
        KV connector reads, spec/operations.md): the largest aligned
        ``L <= max_length`` the group alone can serve, and its blocks."""
        blocks: list[list[KVCacheBlock]] = []
        lengths: list[int] = []
        fine = self.partial_hits_enabled  # sub-block hits: hash-block steps (MPART-1)
        step = self.hash_block_size if fine else self.alignment
        peek = self.peek_limit(block_hashes, max_length)
        hashed = len(block_hashes) * self.hash_block_size
        for manager, cacheable in zip(self.managers, self.cacheable):
            if not cacheable:  # hits nothing (PFX-1)
                blocks.append([])
                lengths.append(0)
                continue
            view = (list(block_hashes) if fine and isinstance(manager, SUB_BLOCK_MANAGERS)
                    else self.view(manager, block_hashes))
            length = max_length // step * step if self.enable_caching else 0
            limit = manager.lookup_limit(max_length, peek, hashed)
            while length > 0 and not manager.can_hit(view, length, limit):
                length -= step
            blocks.append(manager.hit_blocks(view, length, limit) if length else [])
            lengths.append(length)
        return tuple(blocks), tuple(lengths)

    def peek_limit(self, block_hashes: Sequence[BlockHash], max_length: int) -> int:
        """How far an EAGLE group's given-back block may reach (D-SWA-15)."""
        return eagle_peek_limit(max_length, len(block_hashes) * self.hash_block_size, len(self.managers))

    def uncached_shared_prefix(self, block_hashes: Sequence[BlockHash], max_length: int,
                               hit_length: int) -> int:
        """Tokens the leading group (the first full-attention group, else
        group 0) hits beyond the common hit ``hit_length``: a prefix shared
        with an earlier request that a sparser group has not cached. 0 with
        fewer than two groups."""
        if len(self.managers) < 2:
            return 0
        # Only prefix-cacheable groups can lead (PFX-1).
        candidates = [index for index, cacheable in enumerate(self.cacheable) if cacheable]
        if not candidates:
            return 0
        leading = next((index for index in candidates
                        if isinstance(self.managers[index], FullAttentionManager)), candidates[0])
        _, lengths = self.find_longest_cache_hit_per_group(block_hashes, max_length)
        return max(0, lengths[leading] - hit_length)

    def _tokens_for(self, manager: SingleTypeManager, num_tokens: int, num_encoder_tokens: int) -> int:
        return num_encoder_tokens if isinstance(manager, CrossAttentionManager) else num_tokens

    def remove_skipped_blocks(self, *, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Release, in every group, blocks attention no longer reads (a type
        may need the prompt length: R-SWA's gap, RSWA-1)."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_total_computed_tokens, num_prompt_tokens)

    def get_num_blocks_to_allocate(self, *, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                   num_total_computed_tokens: int, num_main_tokens: int,
                                   num_encoder_tokens: int, num_external_computed_tokens: int) -> int:
        """Free blocks all groups together consume for this allocation."""
        return sum(manager.get_num_blocks_to_allocate(
            request_id, self._tokens_for(manager, num_tokens, num_encoder_tokens), hits,
            num_total_computed_tokens, self._tokens_for(manager, num_main_tokens, num_encoder_tokens),
            num_external_computed_tokens)
            for manager, hits in zip(self.managers, new_computed_blocks))

    def checkpoint_demand(self, request_id: str, query_start: int, query_end: int,
                          prefill_end: int) -> int:
        """Blocks the Mamba groups' prefill checkpoints add to an allocation (MCKPT-1)."""
        return sum(1 for manager in self.managers if isinstance(manager, MambaManager)
                   and manager.checkpoint_for(request_id, query_start, query_end, prefill_end) is not None)

    def reserve_checkpoints(self, request_id: str, query_start: int, query_end: int,
                            prefill_end: int) -> None:
        """Record each Mamba group's checkpoint for the allocation about to run."""
        for manager in self.managers:
            if isinstance(manager, MambaManager):
                manager.reserve_checkpoint(request_id, query_start, query_end, prefill_end)

    def full_sequence_demand(self, *, request_id: str, num_tokens: int,
                             new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                             num_encoder_tokens: int) -> int:
        """Free blocks the whole request needs beyond what it holds or hits,
        each group counted at its admission requirement (spec/managers.md §8)."""
        demand = 0
        for manager, hits in zip(self.managers, new_computed_blocks):
            required = manager.admission_blocks(self._tokens_for(manager, num_tokens, num_encoder_tokens))
            demand += max(required - manager.covered_blocks(request_id, hits), 0)
            if request_id not in manager.req_to_blocks:
                demand += sum(1 for block in hits if block.ref_cnt == 0 and not block.is_null)
        return demand

    def admit(self, *, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Make ``request_id`` known, holding its hit blocks in every group (ALLOC-6)."""
        self.known.add(request_id)
        # Every group takes its hit before any group allocates: a fresh block
        # for external tokens could otherwise evict another group's hit (D-API-9).
        for manager, hits in zip(self.managers, new_computed_blocks):
            manager.admit(request_id, hits, num_local_computed_tokens, num_external_computed_tokens)
        for manager in self.managers:
            manager.allocate_external(request_id, num_local_computed_tokens + num_external_computed_tokens,
                                      num_external_computed_tokens)

    def stale_hit(self, block_hashes: Sequence[BlockHash],
                  new_computed_blocks: Sequence[Sequence[KVCacheBlock]]) -> str | None:
        """Why a hit handed back to ``allocate_slots`` is no longer valid (a
        block evicted or reused since ``get_computed_blocks``), or ``None``."""
        for manager, hits in zip(self.managers, new_computed_blocks):
            if not hits:
                continue
            view = self.view(manager, block_hashes)
            for index, block in enumerate(hits):
                if block.is_null:
                    continue
                if isinstance(manager, SUB_BLOCK_MANAGERS) and manager.partial_hits:
                    # A state block may carry the key of any boundary inside it (MPART-1).
                    keys = state_keys_in_block(block_hashes, index, manager.hash_block_size,
                                               manager.block_size)
                    if block.block_hash in {make_block_hash_with_group_id(key, manager.group_id)
                                            for key in keys}:
                        continue
                    if isinstance(manager, FullAttentionSubBlockManager) and manager.extra_entry_serves(
                            block_hashes, index, block):
                        continue
                if index >= len(view) or block.block_hash != make_block_hash_with_group_id(
                        view[index], manager.group_id):
                    return (f"group {manager.group_id} position {index}: block {block.block_id} no longer "
                            "caches that position (evicted or reused since get_computed_blocks)")
        return None

    def allocate_new_blocks(self, *, request_id: str, num_tokens: int, num_main_tokens: int,
                            num_encoder_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Fresh blocks per group so the tokens have slots."""
        return tuple(manager.allocate_new_blocks(
            request_id, self._tokens_for(manager, num_tokens, num_encoder_tokens),
            self._tokens_for(manager, num_main_tokens, num_encoder_tokens)) for manager in self.managers)

    def cache_blocks(self, *, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Cache the full blocks of every group, as far as the request has
        hashes (a lagging hasher's blocks wait for a later call, D-API-11)."""
        hashed = len(request.block_hashes) * self.hash_block_size
        # The last num_reprefillable_tokens computed tokens are re-prefilled by a
        # multi-module drafter, so their KV is not final (D-HASH-12): one group
        # never caches them; several groups only keep them out of an EAGLE
        # group's extra block, as vLLM 0.33 does.
        finalized = min(max(0, num_tokens - self.num_reprefillable_tokens), hashed)
        num_tokens = min(num_tokens, hashed)
        if len(self.managers) == 1:
            num_tokens = finalized
        # Several groups: cache whole alignment units only; an EAGLE group also
        # the block after the last one (D-HIT-5).
        # With sub-block hits every hash block is a unit (MPART-1).
        unit = self.hash_block_size if self.partial_hits_enabled else self.alignment
        aligned = num_tokens // unit * unit if len(self.managers) > 1 else num_tokens
        for manager, cacheable in zip(self.managers, self.cacheable):
            if isinstance(manager, MambaManager):
                manager.caching_end = num_tokens  # a prompt tail is published only there (MPART-4)
            if not cacheable:
                continue
            tokens = aligned
            if manager.use_eagle and aligned > 0:
                # The extent's unit is the caching unit: with sub-block hits
                # nothing is floored to A again (D-MAMBA-36).
                tokens = min(finalized, finalized // unit * unit + manager.block_size)
            manager.cache_blocks(request, self.view(manager, request.block_hashes), request_id, tokens)

    def release(self, request_id: str) -> None:
        """Release every group's blocks, group by group (FREE-2, FREE-6)."""
        self.known.remove(request_id)
        for manager in self.managers:
            manager.release(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's blocks per group."""
        return tuple(list(manager.req_to_blocks[request_id]) for manager in self.managers)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Common prefix blocks per group."""
        return [manager.get_num_common_prefix_blocks(request_id) for manager in self.managers]

    def enable_partial_hash_hits(self, dcp_world_size: int = 1, *, shared_prefix_checkpoint: bool = False) -> None:
        """Turn sub-block hits on (spec/mamba.md, MPART-1..6, FPART-1..5),
        before any request is known; ``dcp_world_size`` is the decode context
        parallelism the block sizes already reflect (D-MAMBA-20). A
        full-attention group larger than the hash block gets the sub-block
        manager. ``shared_prefix_checkpoint``: Mamba groups also publish the
        state at a request's observed junction (MPART-6, D-MAMBA-40).

        Raises:
            InvalidConfigError: the configuration does not support them (D-MAMBA-15, D-MAMBA-21,
                D-MAMBA-40).
            InvalidConfigError: also when requests are already known, or a malformed ``dcp_world_size``.
        """
        kinds = [manager_kind_for(spec) for spec in self._specs]
        configured = self.enable_caching and partial_hits_configured_under_dcp(
            kinds, self._specs, self.block_sizes, self.hash_block_size, check_dcp_world_size(dcp_world_size))
        check_supported(partial_hits_supported(
            kinds, self._specs, self.block_sizes, self.hash_block_size, enable_caching=self.enable_caching,
            use_eagle=self.use_eagle, configured=configured))
        if shared_prefix_checkpoint:
            check_supported(shared_prefix_checkpoint_supported(
                partial_hits_on=True, eagle_groups=self.use_eagle,
                num_reprefillable_tokens=self.num_reprefillable_tokens))
        if self.known:
            raise InvalidConfigError("enable_partial_hash_hits: requests are already known")
        self.partial_hits_enabled = True
        for index, manager in enumerate(self.managers):
            if isinstance(manager, MambaManager):
                manager.cache_hit_alignment_tokens = self.hash_block_size
                manager.partial_hits = manager.block_size != self.hash_block_size
                manager.sub_block_hits = True
                manager.shared_prefix_checkpoint = shared_prefix_checkpoint
            elif type(manager) is FullAttentionManager and manager.block_size != self.hash_block_size:
                self.managers[index] = FullAttentionSubBlockManager.replacing(manager, self.hash_block_size)

    def take_block_copies(self, *, hand_over: bool = False) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Every group's queued copy-on-write pairs, groups in id order; their
        retention references pass to the caller (MPART-3): tracked until
        :meth:`release_copy_retentions`, or with ``hand_over`` plain pool
        references the caller frees itself (D-MAMBA-19)."""
        pairs = [pair for manager in self.managers if isinstance(manager, SUB_BLOCK_MANAGERS)
                 for pair in manager.take_copies()]
        if not hand_over:
            self.retained.update(block.block_id for pair in pairs for block in pair)
        return pairs

    def release_copy_retentions(self, block_ids: Sequence[int]) -> None:
        """Drop one retention reference per id, in order (MPART-3).

        Raises:
            InvalidArgumentError: an id not retained that many times (no change).
        """
        wanted = Counter(block_ids)
        for block_id, times in wanted.items():
            if self.retained[block_id] < times:
                raise InvalidArgumentError(
                    f"block_ids: block {block_id!r} is released {times} time(s) but retained "
                    f"{self.retained[block_id]} time(s) by taken copies")
        self.retained.subtract(wanted)
        self.retained = +self.retained
        self.block_pool.free_blocks([self.block_pool.blocks[block_id] for block_id in block_ids])

    def new_step_starts(self) -> None:
        """A scheduler step begins."""
        for manager in self.managers:
            manager.new_step_starts()


class HybridCoordinator(KVCacheCoordinator):
    """Prefix caching over any number of groups of any attention types (one
    group: the unitary coordinator)."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        # Sub-block hits (MPART-1): hash-block steps; Mamba groups read the
        # hash-block hashes themselves.
        fine = self.partial_hits_enabled
        step = self.hash_block_size if fine else self.alignment
        views = [(list(block_hashes) if fine and isinstance(manager, SUB_BLOCK_MANAGERS)
                  else self.view(manager, block_hashes)) if cacheable else []
                 for manager, cacheable in zip(self.managers, self.cacheable)]
        length = max_length // step * step
        peek = self.peek_limit(block_hashes, max_length)
        hashed = len(block_hashes) * self.hash_block_size
        limits = [manager.lookup_limit(max_length, peek, hashed) for manager in self.managers]
        # LOOKUP-3 by brute force, the definition HYB-1's maximality is checked against.
        # A group outside prefix caching serves every length with no block (PFX-1).
        while length > 0 and not all(not cacheable or manager.can_hit(view, length, limit)
                                     for manager, view, cacheable, limit
                                     in zip(self.managers, views, self.cacheable, limits)):
            length -= step
        return tuple(manager.hit_blocks(view, length, limit) if cacheable else []  # LOOKUP-4
                     for manager, view, cacheable, limit
                     in zip(self.managers, views, self.cacheable, limits)), length


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """No prefix cache: any number of groups, never a hit."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in self.managers), 0


def make_coordinator(kv_cache_config: KVCacheConfig, *, block_pool: BlockPool,
                     block_sizes: Sequence[int], hash_block_size: int, enable_caching: bool,
                     use_eagle: bool, retention_interval: int | None, max_model_len: int,
                     max_num_batched_tokens: int, features: Sequence[Feature] = ()) -> KVCacheCoordinator:
    """The coordinator for a configuration: no prefix cache when caching is
    off or there are no groups, else the hybrid coordinator. It builds the
    managers over ``block_pool``: group ``g`` gets ``block_sizes[g]``; requests are hashed at ``hash_block_size``;
    ``max_model_len`` and ``max_num_batched_tokens`` give the windowed
    groups' admission caps; ``features`` plug in through the hooks of
    :mod:`pagedkv.reference.hooks`."""
    kind = (HybridCoordinator if enable_caching and any(
        prefix_cacheable(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups)
            else NoPrefixCacheCoordinator)
    return kind(kv_cache_config, block_pool=block_pool, block_sizes=block_sizes,
                hash_block_size=hash_block_size, enable_caching=enable_caching, use_eagle=use_eagle,
                retention_interval=retention_interval,
                max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                features=features)
