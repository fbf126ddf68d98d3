"""Mamba states beyond the running one (spec/mamba.md): prefill
checkpoints (MCKPT-1..5), sub-block hits with their copy-on-write
(MPART-1..6), boundary states offered to a KV connector (MOFF-1, MOFF-2,
MTAIL-1) and sparse retention (MRET-1).

The :class:`MambaStates` feature swaps :class:`MambaStateManager` in for
every kernel Mamba manager before any request (H2); the kernel's
:class:`~pagedkv.reference.mamba.MambaManager` stays the seed type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.features.mamba_checkpoint_rules import (
    checkpoint_column,
    checkpoint_exportable,
    checkpoint_position,
    partial_hash_hits_configured,
)
from pagedkv.reference.features.mamba_partial import hit_padding, move_key
from pagedkv.reference.features.mamba_partial_rules import state_key, state_keys_in_block
from pagedkv.reference.features.mamba_publish import publish_checkpoint, publish_resume_state, retention_mask
from pagedkv.reference.hooks import Feature
from pagedkv.reference.mamba import MambaManager
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.request import RequestFacts
from pagedkv.spec.types import BlockHash, make_block_hash_with_group_id

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["MambaStates", "MambaStateManager"]


class MambaStateManager(MambaManager):
    """A Mamba group with checkpoints, sub-block hits and publication."""

    def __init__(self, manager: MambaManager, hash_block_size: int, cache_hit_alignment_tokens: int) -> None:
        assert not manager.req_to_blocks
        super().__init__(manager.kv_cache_spec, block_pool=manager.block_pool, group_id=manager.group_id,
                         block_size=manager.block_size, enable_caching=manager.enable_caching,
                         alignment=manager.alignment, use_eagle=manager.replay_eagle,
                         retention_interval=manager.retention_interval, admission_cap=manager.admission_cap)
        self.hash_block_size = hash_block_size
        # Checkpoints land where vLLM would align hits (MCKPT-4); EAGLE moves them one unit down.
        self.cache_hit_alignment_tokens = cache_hit_alignment_tokens
        self.drop_eagle_checkpoint = manager.replay_eagle
        # request -> (position, column) its latest allocation reserved (MCKPT-1).
        self.checkpoints: dict[str, tuple[int, int]] = {}
        self.caching_checkpoint: tuple[int, int] | None = None  # for ``cache_mask``
        # Boundary states offered to a KV connector until taken (MOFF-1):
        # (request id, block, tokens the state follows), oldest first.
        self.offers: list[tuple[str, KVCacheBlock, int]] = []
        # Sub-block hits (MPART-1..4): lookups read the hash-block hashes.
        # ``partial_hit``: the (column, source) a request copies on its next
        # allocation; ``copies``: queued (source, destination) pairs, each
        # endpoint holding one retention reference (MPART-3).
        self.partial_hits = False
        self.partial_hit: dict[str, tuple[int, KVCacheBlock]] = {}
        self.copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # (request, boundary) published inside a block, once each (MPART-4, MPART-6).
        self.published_tail: set[tuple[str, int]] = set()
        # Resume states are published for the model (MPART-4..6), the observed junction too (D-MAMBA-40).
        self.sub_block_hits = False
        self.shared_prefix_checkpoint = False
        # A producer's published tail not yet handed to a connector (MTAIL-1).
        self.producer_tail: dict[str, tuple[KVCacheBlock, int]] = {}
        self.caching_end = -1  # the unaligned end of the caching call in progress (H6)

    # -- hits ---------------------------------------------------------------------

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        if self.partial_hits and self.mode != "none":
            return self._state_at(block_hashes, length) is not None  # hash-block hashes (MPART-1)
        return super().can_hit(block_hashes, length, max_length)

    def hit_blocks(self, block_hashes: Sequence[BlockHash], length: int,
                   max_length: int | None = None) -> list[KVCacheBlock]:
        if not self.partial_hits or length == 0:
            return super().hit_blocks(block_hashes, length)
        state = self._state_at(block_hashes, length)
        assert state is not None
        return [self.block_pool.null_block] * hit_padding(length, self.block_size) + [state]

    def _state_at(self, fine_hashes: Sequence[BlockHash], length: int) -> KVCacheBlock | None:
        key = state_key(fine_hashes, length, self.hash_block_size, self.block_size)
        return None if key is None else self._lookup(key)

    def holds_hit(self, block_hashes: Sequence[BlockHash], view: Sequence[BlockHash], index: int,
                  block: KVCacheBlock) -> bool:
        # A state block may carry the key of any boundary inside it (MPART-1).
        if self.partial_hits and block.block_hash in {
                make_block_hash_with_group_id(key, self.group_id)
                for key in state_keys_in_block(block_hashes, index, self.hash_block_size, self.block_size)}:
            return True
        return super().holds_hit(block_hashes, view, index, block)

    # -- prefill checkpoints (MCKPT-1) ----------------------------------------------

    def checkpoint_for(self, request_id: str, query_start: int, query_end: int,
                       prefill_end: int) -> tuple[int, int] | None:
        """The (position, column) the chunk ``[query_start, query_end)``
        reserves, or ``None`` (MCKPT-1)."""
        spec = self.kv_cache_spec
        assert isinstance(spec, MambaSpec)
        if not self.enable_caching or not spec.has_prefill_checkpoints:
            return None
        if self.retention_interval == 0 and query_end < prefill_end:
            return None
        position = checkpoint_position(query_end, self.cache_hit_alignment_tokens,
                                       self.drop_eagle_checkpoint, self.hash_lookahead_tokens())
        column = checkpoint_column(query_end, self.block_size)
        if column < 0 or not checkpoint_exportable(
                query_start=query_start, query_end=query_end, position=position,
                hash_block_size=self.hash_block_size, block_size=self.block_size,
                export_alignment=spec.prefill_checkpoint_alignment):
            return None
        blocks = self.req_to_blocks.get(request_id, [])
        column_free = (column >= len(blocks) or blocks[column].is_null
                       or (request_id in self.given_state
                           and column >= len(blocks) - self.num_speculative_blocks))
        return (position, column) if column_free else None

    def hash_lookahead_tokens(self) -> int:
        """Tokens past a block its hash covers (spec/hashing.md §7)."""
        return self.block_pool.num_hash_lookahead_tokens

    def reserve_checkpoint(self, request_id: str, query_start: int, query_end: int, prefill_end: int) -> None:
        """Record this allocation's checkpoint, or that it has none."""
        found = self.checkpoint_for(request_id, query_start, query_end, prefill_end)
        if found is None:
            self.checkpoints.pop(request_id, None)
        else:
            self.checkpoints[request_id] = found

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        # Sparse retention (MRET-1); a checkpoint block is never keyed by its
        # full-block key (MCKPT-3): ``publish_checkpoint`` keys it, or not (MCKPT-5).
        mask = retention_mask(self, request, num_cached, num_full)
        found = self.caching_checkpoint
        if found is None or not num_cached <= found[1] < num_full:
            return mask
        mask = [True] * (num_full - num_cached) if mask is None else list(mask)
        mask[found[1] - num_cached] = False
        return mask

    # -- allocation -----------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int,
                                   num_main_tokens: int, num_external_computed_tokens: int = 0) -> int:
        demand = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                    num_total_computed_tokens, num_main_tokens,
                                                    num_external_computed_tokens)
        # A hit ending inside a block (or a producer's published tail) takes
        # one more block: the copy's destination (MPART-2).
        local = num_total_computed_tokens - num_external_computed_tokens
        if self.mode == "align" and self.partial_hits and (request_id in self.partial_hit or (
                new_computed_blocks and not num_external_computed_tokens and local % self.block_size)):
            return demand + 1
        return demand

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[KVCacheBlock]:
        if self.mode != "align":
            return super().allocate_new_blocks(request_id, num_tokens, num_main_tokens)
        partial = self.partial_hit.pop(request_id, None)
        copied: list[KVCacheBlock] = []
        if partial is not None:
            given_before = request_id in self.given_state
            destination = self._copy_on_write(request_id, partial, given_before)
            if destination is not None and not given_before:
                copied.append(destination)
        # A reserved checkpoint column is not padded: it gets a real block.
        return copied + self.allocate_state_blocks(request_id, num_main_tokens,
                                                   real_column=request_id in self.checkpoints,
                                                   always=partial is not None)

    def _copy_on_write(self, request_id: str, partial: tuple[int, KVCacheBlock],
                       given_before: bool) -> KVCacheBlock | None:
        """Take the copy's destination and queue ``(source, destination)``,
        each endpoint holding one retention reference (MPART-3). A new
        request's hit moves onto the copy; a running producer keeps its block
        and the published key moves to the copy (MPART-4)."""
        column, source = partial
        blocks = self.req_to_blocks[request_id]
        if blocks[column] is not source:
            return None  # the published state was released since: nothing to copy
        destination = self.block_pool.get_new_blocks(1)[0]
        if given_before:
            move_key(self.block_pool, source, destination)
            source.ref_cnt += 1  # the retention: the request keeps its own
            if destination.block_hash is not None:
                self.cached_this_step.add(destination.block_hash)  # filled by this step's copy
            tail = self.producer_tail.pop(request_id, None)
            if tail is not None and tail[0] is source:
                self.offers.append((request_id, destination, tail[1]))  # MOFF-2
        else:
            blocks[column] = destination  # the hit reference on ``source`` becomes its retention
            destination.ref_cnt += 1
        self.copies.append((source, destination))
        return destination

    def take_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The queued copies, oldest first; the queue is emptied."""
        copies, self.copies = self.copies, []
        return copies

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        super().admit(request_id, new_computed_blocks, num_local_computed_tokens,
                      num_external_computed_tokens)
        if (self.partial_hits and new_computed_blocks and not num_external_computed_tokens
                and num_local_computed_tokens % self.block_size):
            # The hit ends inside its state block: copied before writing (MPART-2).
            column = num_local_computed_tokens // self.block_size
            self.partial_hit[request_id] = (column, self.req_to_blocks[request_id][column])
            self.num_cached_blocks[request_id] = column

    # -- caching and freeing ------------------------------------------------------------

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        if self.mode == "none":
            return
        before = self.num_cached_blocks[request_id]
        self.caching_checkpoint = self.checkpoints.get(request_id)
        try:
            SingleTypeManager.cache_blocks(self, request, block_hashes, request_id, num_tokens)
        finally:
            self.caching_checkpoint = None
        if self.mode == "align":
            publish_checkpoint(self, request, request_id)
        for block in self.req_to_blocks[request_id][before:self.num_cached_blocks[request_id]]:
            if block.block_hash is not None:
                self.cached_this_step.add(block.block_hash)
                if self.mode == "align":  # the tokens its key covers (MOFF-1)
                    self.offers.append((request_id, block, block.key_tokens))
        if self.sub_block_hits and self.mode == "align":
            publish_resume_state(self, request, request_id, num_tokens)

    def take_offers(self) -> list[tuple[str, KVCacheBlock, int]]:
        """The boundary states offered since the last call, oldest first."""
        offers, self.offers = self.offers, []
        return offers

    def finalize_partial_tail(self, request_id: str, num_computed_tokens: int,
                              num_in_flight_tokens: int) -> tuple[KVCacheBlock, int] | None:
        """A finishing producer's tail block and boundary when no token past
        it ran (MTAIL-1); the record is consumed either way."""
        tail = self.producer_tail.pop(request_id, None)
        if tail is None or num_in_flight_tokens != 0 or num_computed_tokens != tail[1]:
            return None
        return tail

    def release(self, request_id: str) -> None:
        # An offer not taken would name a block the pool may hand out next (MOFF-1).
        self.offers = [offer for offer in self.offers if offer[0] != request_id]
        self.checkpoints.pop(request_id, None)
        self.partial_hit.pop(request_id, None)
        self.published_tail = {entry for entry in self.published_tail if entry[0] != request_id}
        self.producer_tail.pop(request_id, None)
        super().release(request_id)


class MambaStates(Feature):
    """Installs :class:`MambaStateManager` (H2), counts and reserves a
    prefill checkpoint's block (H5) and notes the end of a caching call (H6)."""

    def configure(self, coordinator: KVCacheCoordinator) -> None:
        specs = [group.kv_cache_spec for group in coordinator.kv_cache_groups]
        # MCKPT-4: the hash block with sub-block hits configured, else the coordinator's alignment.
        fine = coordinator.enable_caching and partial_hash_hits_configured(
            [manager_kind_for(spec) for spec in specs], specs, coordinator.block_sizes,
            coordinator.hash_block_size)
        unit = coordinator.hash_block_size if fine else coordinator.alignment
        for index, manager in enumerate(coordinator.managers):
            if isinstance(manager, MambaManager):
                coordinator.managers[index] = MambaStateManager(manager, coordinator.hash_block_size, unit)

    def step_blocks(self, coordinator: KVCacheCoordinator, request: RequestFacts, request_id: str,
                    query_start: int, query_end: int, reserve: bool) -> int:
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        managers = [manager for manager in coordinator.managers if isinstance(manager, MambaStateManager)]
        if reserve:
            for manager in managers:
                manager.reserve_checkpoint(request_id, query_start, query_end, prefill_end)
        return sum(1 for manager in managers
                   if manager.checkpoint_for(request_id, query_start, query_end, prefill_end) is not None)

    def caching(self, coordinator: KVCacheCoordinator, request_id: str, num_tokens: int) -> None:
        for manager in coordinator.managers:
            if isinstance(manager, MambaStateManager):
                manager.caching_end = num_tokens  # a prompt tail is published only there (MPART-4)
