"""Coordinators: drive the per-group managers over one shared block pool.

A coordinator holds the manager's state: the pool (built by the facade, as
in ``pagedkv.reference``, and handed in), one single-type manager per KV
cache group and the set of known requests. It answers for all groups at once: how many blocks
an allocation takes in total, admit a request (every group takes its hit
before any group allocates, D-API-9), allocate in every group, cache,
release group by group, and find a prefix hit common to the groups. It also
holds the decode fast path of ``allocate_slots`` (:meth:`decode_step`),
beside the tables it reads; what sub-block hits add (hit checks,
copy-on-write retention) is the mixin in ``coordinator_sub_block``. The
kinds (no prefix cache, unitary, hybrid) and :func:`make_coordinator`,
which picks one, are in ``coordinator_kinds``. Arguments are assumed valid:
the facade validates first (``validation.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from math import lcm
from typing import Any

from pagedkv.optimized.coordination.admission import admission_caps, full_sequence_demand
from pagedkv.optimized.coordination.coordinator_checks import CoordinatorChecks
from pagedkv.optimized.coordination.coordinator_sub_block import SubBlockCoordination
from pagedkv.optimized.groups import group_hits
from pagedkv.optimized.groups.cross_attention import CrossAttentionManager
from pagedkv.optimized.groups.dcp_partial import FullAttentionSubBlockManager
from pagedkv.optimized.groups.eagle import apply_eagle_groups
from pagedkv.optimized.groups.hybrid_search import HashViews
from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.ring import RingManager
from pagedkv.optimized.groups.rswa import RSWAManager
from pagedkv.optimized.groups.single_type import FullAttentionManager, SingleTypeManager, SinkFullAttentionManager
from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.optimized.paths.admit_path import AdmitStep, single_admit_step
from pagedkv.optimized.paths.decode import decode_probes
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH, DecodeStep, probed_decode_step
from pagedkv.optimized.paths.fill_path import probed_fill_step
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.optimized.pool.hasher import REQUEST_TYPE
from pagedkv.optimized.rules.dcp_rules import check_dcp_world_size, partial_hits_configured_under_dcp
from pagedkv.optimized.rules.eagle_rules import eagle_peek_limit
from pagedkv.optimized.rules.mamba_checkpoint_rules import partial_hash_hits_configured
from pagedkv.optimized.rules.mamba_partial_rules import (
    check_supported,
    partial_hits_supported,
    shared_prefix_checkpoint_supported,
)
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.request import Request, RequestFacts
from pagedkv.spec.types import BlockHash

__all__ = [
    "KVCacheCoordinator",
    "MANAGER_FOR_KIND",
    "RawHashViews",
    "TAKE_GENERAL_PATH",
]

MANAGER_FOR_KIND: dict[str, type[SingleTypeManager]] = {
    "full_attention": FullAttentionManager,
    "sink_full_attention": SinkFullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalAttentionManager,
    "mamba": MambaManager,
    "cross_attention": CrossAttentionManager,
    "circular_buffer": RingManager,
    "rswa": RSWAManager,
}
"""The optimized manager for each manager kind of :mod:`pagedkv.spec.registry`."""


class KVCacheCoordinator(SubBlockCoordination, CoordinatorChecks):
    """The pool, the managers of every group, and the known requests.

    Args:
        kv_cache_config: the groups.
        block_pool: the shared pool (built by the facade).
        block_sizes: tokens per block of each group (spec size * dcp * pcp).
        hash_block_size: tokens per request block hash (divides every block size).
        enable_caching: prefix caching on.
        use_eagle: hits keep the next block cached (EAGLE rule).
        retention_interval: sliding-window cache thinning (``windowed``).
        max_model_len: most tokens one request may hold.
        max_num_batched_tokens: the per-step token budget the windowed
            admission caps count with (CFG-7, CFG-8).

    Raises:
        InvalidConfigError: a spec whose manager kind has no optimized manager,
            or a sink group the pool cannot hold.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, *, block_pool: BlockPool,
                 block_sizes: Sequence[int], hash_block_size: int, enable_caching: bool,
                 use_eagle: bool, retention_interval: int | None, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.block_sizes = tuple(block_sizes)
        self.max_model_len = max_model_len
        # Groups outside prefix caching (bounded-replay windows) neither hit
        # nor cache nor bound the hit alignment (PFX-1, D-API-40).
        self.cacheable: tuple[bool, ...] = tuple(prefix_cacheable(group.kv_cache_spec) for group in groups)
        cacheable_sizes = [size for size, cacheable in zip(self.block_sizes, self.cacheable) if cacheable]
        self.alignment = lcm(*cacheable_sizes) if cacheable_sizes else 1
        self.block_pool = block_pool
        managers: list[SingleTypeManager] = []
        for group_id, group in enumerate(groups):
            kind = manager_kind_for(group.kv_cache_spec)
            manager_class = MANAGER_FOR_KIND.get(kind)
            if manager_class is None:
                raise InvalidConfigError(
                    f"kv_cache_groups[{group_id}]: manager kind {kind!r} has no optimized manager")
            managers.append(manager_class(
                group.kv_cache_spec, block_pool=self.block_pool, group_id=group_id,
                block_size=block_sizes[group_id], enable_caching=enable_caching,
                alignment=self.alignment, use_eagle=use_eagle,
                retention_interval=retention_interval))
        self.managers: tuple[SingleTypeManager, ...] = tuple(managers)
        # new_step_starts runs once per scheduler step: only the managers
        # whose hook does something (Mamba's), not the base class's no-op.
        self._stepped_managers = tuple(
            manager for manager in self.managers
            if type(manager).new_step_starts is not SingleTypeManager.new_step_starts)
        self.cacheable_managers: tuple[SingleTypeManager, ...] = tuple(
            manager for manager, cacheable in zip(managers, self.cacheable) if cacheable)
        # Prefill checkpoints land where vLLM would align hits (MCKPT-4).
        self.mamba_managers: tuple[MambaManager, ...] = tuple(
            manager for manager in managers if isinstance(manager, MambaManager))
        # Groups that queue copy-on-write copies (full attention joins with sub-block hits).
        self.copy_managers: tuple[MambaManager | FullAttentionSubBlockManager, ...] = self.mamba_managers
        self.partial_hash_hits = enable_caching and partial_hash_hits_configured(
            [manager_kind_for(group.kv_cache_spec) for group in groups],
            [group.kv_cache_spec for group in groups], self.block_sizes, hash_block_size)
        for mamba in self.mamba_managers:
            mamba.hash_block_size = hash_block_size
            mamba.drop_eagle_checkpoint = use_eagle
            mamba.cache_hit_alignment_tokens = hash_block_size if self.partial_hash_hits else self.alignment
        # EAGLE per group: marked groups and their same-spec siblings (D-SWA-14).
        apply_eagle_groups(managers, groups, self.block_sizes, use_eagle)
        self._use_eagle = use_eagle
        self._kinds = tuple(manager_kind_for(group.kv_cache_spec) for group in groups)
        self._specs = tuple(group.kv_cache_spec for group in groups)
        self.partial_hits_enabled = False
        # Copy endpoints taken and not yet released, with multiplicity (MPART-3).
        self.retained: Counter[int] = Counter()
        # Cross-attention groups count encoder tokens, the others decoder tokens.
        self.encoder_groups: tuple[bool, ...] = tuple(
            isinstance(manager, CrossAttentionManager) for manager in managers)
        # Known requests (holding an allocation): needed apart from the
        # managers' tables because a config may have zero groups.
        self.requests: set[str] = set()
        # The per-request caps startup sizing counts (spec CFG-7, CFG-8).
        self.admission_caps = admission_caps(self.managers, max_num_batched_tokens, max_model_len)
        # Shared empty result: never mutated (KVCacheBlocks lists are not).
        self.empty_blocks = KVCacheBlocks(
            tuple([] for _ in self.managers), self.block_pool.block_hashes)
        # Tokens a multi-module drafter re-prefills, never cached (D-HASH-12);
        # the facade sets it (and drops the decode fast path when it is not 0).
        self.num_reprefillable_tokens = 0
        self.decode_step: DecodeStep | None = None
        """The decode fast path for this configuration, or ``None``."""
        self.well_formed_request_types: set[type] = {Request, REQUEST_TYPE}
        """Request classes whose ``num_tokens`` is an int >= 1 by
        construction: the decode step's no-op test does not read it from
        them (D-PERF-22). An adapter may add its engine's class."""
        self.request_facts_readers: dict[type, Callable[[Any], RequestFacts]] = {}
        """Per request class, how the decode step's filling branch takes the
        request's facts (``RequestFacts.capture`` for any other class): an
        adapter registers its engine's class with the snapshot its own
        general path builds, so both paths see the same facts (D-PERF-37)."""
        self.admit_step: AdmitStep | None = None
        """The admission fast path (``admit_path``), or ``None``."""
        if (len(managers) == 1 and block_sizes[0] == hash_block_size and enable_caching
                and type(managers[0]) is FullAttentionManager):
            # One full-attention group hashed at its size: the common case.
            self.admit_step = single_admit_step(self)
        probes = decode_probes(self.managers) if managers else None
        if probes is not None:
            self.decode_step = probed_decode_step(self, probes, probed_fill_step(self))

    # ------------------------------------------------------- decode fast path

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[int], ...], int]:
        """The prefix hit: blocks per group and the tokens they cover. Pure.

        Cost: depends on the kind.
        """
        raise NotImplementedError

    def one_group_scan(self) -> tuple[Callable[..., list[int] | None], dict[bytes, int], int, BlockPool] | None:
        """What the manager may call in place of :meth:`find_longest_cache_hit`
        (``UnitaryCoordinator``'s; None for the other kinds). Cost: O(1)."""
        return None

    def native_release(self) -> Callable[[str], None] | None:
        """What the manager may call in place of :meth:`release` (the C
        release of ``UnitaryCoordinator``; None for the other kinds). Cost: O(1)."""
        return None

    def find_longest_cache_hit_per_group(
            self, block_hashes: Sequence[BlockHash],
            max_cache_hit_length: int) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """Each group's own longest hit, not reconciled (``group_hits``). Pure."""
        if not self.enable_caching:
            return tuple([] for _ in self.managers), tuple(0 for _ in self.managers)
        blocks, lengths = group_hits.per_group_hits(
            self.cacheable_managers,
            self.views(block_hashes, max_cache_hit_length), max_cache_hit_length, self.hit_unit,
            self.peek_limit(block_hashes, max_cache_hit_length))
        # A group outside prefix caching hits nothing (PFX-1).
        found = iter(zip(blocks, lengths))
        pairs = [next(found) if cacheable else ([], 0) for cacheable in self.cacheable]
        return tuple(pair[0] for pair in pairs), tuple(pair[1] for pair in pairs)

    def uncached_shared_prefix(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int,
                               hit_length: int) -> int:
        """Tokens the leading group hits beyond the common hit (``group_hits``). Pure."""
        if len(self.managers) < 2 or not self.enable_caching:
            return 0
        if not self.cacheable_managers:
            return 0
        # Only prefix-cacheable groups can lead (PFX-1).
        return group_hits.uncached_shared_prefix(
            self.cacheable_managers, self.views(block_hashes, max_cache_hit_length), max_cache_hit_length,
            self.hit_unit, hit_length, self.peek_limit(block_hashes, max_cache_hit_length))

    def peek_limit(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int) -> int:
        """How far an EAGLE group's given-back block may reach (D-SWA-15). Cost: O(1)."""
        return eagle_peek_limit(max_cache_hit_length, len(block_hashes) * self.hash_block_size,
                                len(self.managers))

    def views(self, block_hashes: Sequence[BlockHash], max_tokens: int | None = None) -> HashViews:
        """The request's hashes per group block size (the hash-block hashes
        for every group with sub-block hits, MPART-1). Cost: O(1) (lazy)."""
        if self.partial_hits_enabled:
            return RawHashViews(block_hashes, self.hash_block_size)
        return HashViews(block_hashes, self.hash_block_size, max_tokens)

    @property
    def hit_unit(self) -> int:
        """The granularity of hit lengths: the hash block with sub-block hits, else the alignment."""
        return self.hash_block_size if self.partial_hits_enabled else self.alignment

    def get_num_blocks_to_allocate(self, *, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[list[int], ...] | None,
                                   num_total_computed_tokens: int, num_main_tokens: int,
                                   num_encoder_tokens: int, num_external_computed_tokens: int) -> int:
        """Free blocks all groups take from the free queue. Cost: O(groups + hit blocks)."""
        total = 0
        for group_id, (manager, encoder) in enumerate(zip(self.managers, self.encoder_groups)):
            computed: Sequence[int] = (
                () if new_computed_blocks is None else new_computed_blocks[group_id])
            # Cross-attention groups are sized by the encoder tokens.
            total += manager.get_num_blocks_to_allocate(
                request_id, num_encoder_tokens if encoder else num_tokens, computed,
                num_total_computed_tokens, num_encoder_tokens if encoder else num_main_tokens,
                num_external_computed_tokens)
        return total

    def checkpoint_demand(self, request_id: str, query_start: int, query_end: int,
                          prefill_end: int) -> int:
        """Blocks the Mamba groups' prefill checkpoints add (MCKPT-1). Cost: O(Mamba groups)."""
        demand = 0
        for mamba in self.mamba_managers:
            if mamba.checkpoint_for(request_id, query_start, query_end, prefill_end) is not None:
                demand += 1
        return demand

    def reserve_checkpoints(self, request_id: str, query_start: int, query_end: int,
                            prefill_end: int) -> None:
        """Record each Mamba group's checkpoint for the allocation about to
        run. Cost: O(Mamba groups)."""
        for mamba in self.mamba_managers:
            mamba.reserve_checkpoint(request_id, query_start, query_end, prefill_end)

    def full_sequence_demand(self, *, request_id: str, num_tokens: int,
                             new_computed_blocks: tuple[list[int], ...] | None,
                             num_encoder_tokens: int) -> int:
        """Free blocks the whole request needs beyond what it holds or hits,
        each group counted at its admission requirement (spec/managers.md
        §8; ``admission.py``). Cost: O(groups + blocks held or hit)."""
        return full_sequence_demand(
            self.managers, self.admission_caps, request_id, num_tokens, new_computed_blocks,
            num_encoder_tokens, self.block_pool.ref_counts)

    def admit(self, *, request_id: str, new_computed_blocks: tuple[list[int], ...] | None,
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Make a new request known: every group takes its hit before any
        group allocates blocks for external tokens, which could otherwise
        evict another group's hit (D-API-9).
        Cost: O(groups + hit blocks + external blocks)."""
        self.requests.add(request_id)
        managers = self.managers
        for group_id, manager in enumerate(managers):
            computed: Sequence[int] = (
                () if new_computed_blocks is None else new_computed_blocks[group_id])
            manager.admit(request_id, computed, num_local_computed_tokens,
                          num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            total = num_local_computed_tokens + num_external_computed_tokens
            for manager in managers:
                manager.allocate_external(request_id, total, num_external_computed_tokens)

    def allocate_new_blocks(self, *, request_id: str, num_tokens: int, num_main_tokens: int,
                            num_encoder_tokens: int) -> tuple[list[int], ...]:
        """New blocks per group so the tokens have slots.
        Cost: O(groups + new blocks)."""
        return tuple([
            manager.allocate_new_blocks(request_id, num_encoder_tokens, num_encoder_tokens)
            if encoder else manager.allocate_new_blocks(request_id, num_tokens, num_main_tokens)
            for manager, encoder in zip(self.managers, self.encoder_groups)])

    def cache_blocks(self, *, request: HashedRequest, request_id: str, num_tokens: int) -> None:
        """Cache the blocks ``num_tokens`` fill, in every group, each under
        its view of the request's hashes.
        Cost: O(groups + blocks newly cached + view blocks built)."""
        hash_block_size = self.hash_block_size
        # Only blocks with hashes are cached; a lagging hasher's blocks wait
        # for a later call (D-API-11).
        hashed_tokens = len(request.block_hashes) * hash_block_size
        # Re-prefilled tokens are not final (D-HASH-12): one group never
        # caches them, several keep them out of an EAGLE group's extra block.
        finalized = num_tokens - self.num_reprefillable_tokens
        if finalized > hashed_tokens:
            finalized = hashed_tokens
        if finalized < 0:
            finalized = 0
        if num_tokens > hashed_tokens:
            num_tokens = hashed_tokens
        views: HashViews | None = None
        managers = self.managers
        if len(managers) == 1:
            num_tokens = finalized
        # Several groups: only whole alignment units can ever be hit, so
        # caching stops at the last one; an EAGLE group caches the block
        # past it, which its hit predicate reads (D-HIT-5).
        # With sub-block hits every hash block is a unit (MPART-1).
        unit = self.hash_block_size if self.partial_hits_enabled else self.alignment
        aligned = num_tokens - num_tokens % unit if len(managers) > 1 else num_tokens
        for mamba in self.mamba_managers:
            mamba.caching_end = num_tokens  # a prompt tail is published only there (MPART-4)
        for manager, cacheable in zip(managers, self.cacheable):
            if not cacheable:
                continue
            tokens = aligned
            if manager.use_eagle and aligned > 0:
                # Floored to the caching unit, not A (D-MAMBA-36).
                tokens = min(finalized, finalized - finalized % unit + manager.block_size)
            if manager.block_size == hash_block_size:
                manager.cache_blocks(request, None, request_id, tokens)
            else:
                if views is None:
                    views = HashViews(request.block_hashes, hash_block_size, num_tokens)
                manager.cache_blocks(request, views.at(manager.block_size), request_id, tokens)

    def remove_skipped_blocks(self, *, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Release blocks no longer needed, per group; an R-SWA group its gap
        blocks when told the prompt length (RSWA-1). Cost: O(groups + released)."""
        for manager in self.managers:
            if num_prompt_tokens is not None and isinstance(manager, RSWAManager):
                manager.remove_gap_blocks(request_id, num_total_computed_tokens, num_prompt_tokens)
            else:
                manager.remove_skipped_blocks(request_id, num_total_computed_tokens)

    def release(self, request_id: str) -> None:
        """Release the request's blocks group by group (tail first within a
        group) and forget it (FREE-2, FREE-6). Cost: O(blocks held)."""
        self.requests.remove(request_id)
        for manager in self.managers:
            manager.release(request_id)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, leading blocks every known request holds.
        Cost: O(groups + common blocks)."""
        num_requests = len(self.requests)
        return [manager.get_num_common_prefix_blocks(request_id, num_requests)
                for manager in self.managers]

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        """The request's live block lists per group. Cost: O(groups)."""
        return tuple([manager.req_to_blocks[request_id] for manager in self.managers])

    def get_num_cached_blocks(self, request_id: str) -> tuple[int, ...]:
        """The request's cached-block count per group. Cost: O(groups)."""
        return tuple(manager.num_cached_blocks[request_id] for manager in self.managers)

    def enable_partial_hash_hits(self, dcp_world_size: int = 1, *, shared_prefix_checkpoint: bool = False) -> None:
        """Turn sub-block hits on before any request is known (MPART-1..6,
        FPART-1..5): check the configuration (D-MAMBA-15, D-MAMBA-20, D-MAMBA-21,
        D-MAMBA-40), then give every Mamba group hash-block alignment and every
        full-attention group larger than the hash block the sub-block manager.

        Raises:
            InvalidConfigError: unsupported configuration (D-MAMBA-15, D-MAMBA-21,
                D-MAMBA-40), requests already known, bad ``dcp_world_size``.
        Cost: O(groups).
        """
        hash_size = self.hash_block_size
        kinds, specs = self._kinds, self._specs
        configured = self.enable_caching and partial_hits_configured_under_dcp(
            kinds, specs, self.block_sizes, hash_size, check_dcp_world_size(dcp_world_size))
        check_supported(partial_hits_supported(
            kinds, specs, self.block_sizes, hash_size, enable_caching=self.enable_caching,
            use_eagle=self._use_eagle, configured=configured))
        if shared_prefix_checkpoint:
            check_supported(shared_prefix_checkpoint_supported(
                partial_hits_on=True, eagle_groups=self._use_eagle,
                num_reprefillable_tokens=self.num_reprefillable_tokens))
        if self.requests:
            raise InvalidConfigError("enable_partial_hash_hits: requests are already known")
        self.partial_hits_enabled = self.partial_hash_hits = True
        # A producer's published tail makes its next step allocate a copy,
        # which the decode fast path does not know: general path only (D-MAMBA-17).
        self.decode_step = None
        managers = list(self.managers)
        for index, manager in enumerate(managers):
            # Hits land on every hash block (a Mamba group at the hash block size included).
            manager.alignment = hash_size
            if isinstance(manager, MambaManager):
                manager.cache_hit_alignment_tokens = hash_size
                manager.partial_hits = manager.block_size != hash_size
                manager.sub_block_hits = manager.mode == "align"
                manager.shared_prefix_checkpoint = shared_prefix_checkpoint
            elif type(manager) is FullAttentionManager and manager.block_size != hash_size:
                managers[index] = FullAttentionSubBlockManager.replacing(manager, hash_size)
        self.managers = tuple(managers)
        self.cacheable_managers = tuple(
            manager for manager, cacheable in zip(managers, self.cacheable) if cacheable)
        self.copy_managers = tuple(
            manager for manager in managers if isinstance(manager, (MambaManager, FullAttentionSubBlockManager)))

    @property
    def has_step_hooks(self) -> bool:
        """Whether :meth:`new_step_starts` does anything (some group has a per-step
        hook): an engine may skip the call when not. Cost: O(1)."""
        return bool(self._stepped_managers)

    def new_step_starts(self) -> None:
        """Per-step hook of every manager (those that have one). Cost: O(groups)."""
        for manager in self._stepped_managers:
            manager.new_step_starts()


class RawHashViews(HashViews):
    """Every block size sees the hash-block hashes themselves (sub-block hits)."""

    __slots__ = ()

    def at(self, block_size: int) -> Sequence[BlockHash]:
        """The request's own list. Cost: O(1)."""
        return self.block_hashes
