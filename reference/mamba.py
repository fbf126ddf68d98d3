"""Mamba (state-space) layers: one running state per request instead of
per-token KV (spec/managers.md, MAMBA-1, MAMBA-2).

Modes (``MambaSpec.mamba_cache_mode``):
- ``"none"``: the state is never cached; a hit can only be empty.
- ``"all"``: every full block's state is cached; a hit of ``L`` tokens needs
  only the state block ending at ``L``.
- ``"align"``: the state lives in the last block(s) of the request, copied
  forward each step; the previous step's block is released once the copy no
  longer needs it.
``num_speculative_blocks`` extra blocks hold draft states (MTP/EAGLE).
With prefill checkpoints (``MambaSpec.has_prefill_checkpoints``) a chunk
may also reserve the block at the worker's checkpoint column, where the
worker exports the state at a hash boundary inside the chunk
(spec/mamba.md, MCKPT-1..3).
A state cached during a step cannot serve a hit in that same step (its
contents are written by the step), so such a hit is refused until
``new_step_starts``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference import rules
from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.features.mamba_checkpoint_rules import (
    checkpoint_column,
    checkpoint_exportable,
    checkpoint_position,
)
from pagedkv.reference.features.mamba_partial import hit_padding, move_key
from pagedkv.reference.features.mamba_partial_rules import state_key
from pagedkv.reference.features.mamba_publish import (
    finalize_partial_tail,
    publish_checkpoint,
    publish_resume_state,
    retention_mask,
)
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import BlockHash, BlockHashWithGroupId

__all__ = ["MambaManager"]


class MambaManager(SingleTypeManager):
    """One Mamba group; see the module docstring for the modes."""

    uses_eagle_rule = False

    def __init__(self, kv_cache_spec: KVCacheSpec, *, block_pool: BlockPool, group_id: int,
                 block_size: int, enable_caching: bool, alignment: int, use_eagle: bool,
                 retention_interval: int | None = None, admission_cap: int | None = None) -> None:
        super().__init__(kv_cache_spec, block_pool=block_pool, group_id=group_id,
                         block_size=block_size, enable_caching=enable_caching, alignment=alignment,
                         use_eagle=use_eagle, retention_interval=retention_interval,
                         admission_cap=admission_cap)
        spec = kv_cache_spec
        assert isinstance(spec, MambaSpec)
        self.mode = spec.mamba_cache_mode
        self.num_speculative_blocks = spec.num_speculative_blocks
        self.cached_this_step: set[BlockHashWithGroupId] = set()
        # align mode: index of the state block the previous step wrote, and
        # the requests that have been given state blocks at least once.
        self.last_state_block: dict[str, int] = {}
        self.given_state: set[str] = set()
        # Prefill checkpoints: request -> (position, column) reserved by its
        # latest allocation (MCKPT-1). The coordinator sets the alignment
        # and hash block size; EAGLE moves checkpoints one unit down.
        self.checkpoints: dict[str, tuple[int, int]] = {}
        self.cache_hit_alignment_tokens = alignment
        self.hash_block_size = 1
        self.drop_eagle_checkpoint = use_eagle
        # The checkpoint of the request ``cache_blocks`` is caching, for ``cache_mask``.
        self.caching_checkpoint: tuple[int, int] | None = None
        # Boundary states offered to a KV connector, oldest first, until taken
        # (MOFF-1): (request id, block, tokens the state follows).
        self.offers: list[tuple[str, KVCacheBlock, int]] = []
        # Sub-block hits (spec/mamba.md, MPART-1..4), switched on by the
        # coordinator: hits are then looked up on the request's hash-block
        # hashes. ``partial_hit`` is the block (column, source) a request must
        # copy on its next allocation; ``copies`` the queued (source,
        # destination) pairs, each endpoint holding one retention reference.
        self.partial_hits = False
        self.partial_hit: dict[str, tuple[int, KVCacheBlock]] = {}
        self.copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # (request, boundary) pairs a request published inside a block: once
        # each, so the block a producer keeps writing after its copy is never
        # keyed again (MPART-4, MPART-6).
        self.published_tail: set[tuple[str, int]] = set()
        # Sub-block hits are on for the model (every Mamba group, whatever its
        # block): resume states are published (MPART-4..6); with
        # ``shared_prefix_checkpoint`` the observed junction too (D-MAMBA-40).
        self.sub_block_hits = False
        self.shared_prefix_checkpoint = False
        # A producer's published tail not yet handed to a connector (MTAIL-1):
        # request -> (block, boundary).
        self.producer_tail: dict[str, tuple[KVCacheBlock, int]] = {}
        # The unaligned end of the caching call in progress (set by the coordinator).
        self.caching_end = -1

    # -- hits ---------------------------------------------------------------------

    def hit_span(self, length: int) -> tuple[int, int]:
        end = length // self.block_size
        return max(0, end - 1), end

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        if self.mode == "none":
            return length == 0
        if self.partial_hits:
            # ``block_hashes`` are the hash-block hashes: the state after
            # ``length`` tokens, under its full or partial key (MPART-1).
            return self._state_at(block_hashes, length) is not None
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

    def skipped_tokens(self, num_computed: int) -> int:
        # Only the state after the last computed token is needed.
        return num_computed - 1

    def released_tokens(self, num_total_computed_tokens: int) -> int:
        # The count is already on the settled basis (in-flight tokens, draft
        # ones included, are left out by the caller: D-API-14), so no
        # further discount for speculative tokens (D-MAMBA-3).
        return self.skipped_tokens(num_total_computed_tokens)

    # -- prefill checkpoints ----------------------------------------------------------

    def checkpoint_for(self, request_id: str, query_start: int, query_end: int,
                       prefill_end: int) -> tuple[int, int] | None:
        """The (position, column) a chunk ``[query_start, query_end)`` reserves, or
        ``None`` (MCKPT-1): the worker exports there, the column is free for it,
        and under retention interval 0 only the chunk reaching ``prefill_end`` does."""
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
        """Tokens past a block each block hash covers (lookahead hashing,
        spec/hashing.md): a checkpoint keeps them inside the prompt."""
        return self.block_pool.num_hash_lookahead_tokens

    def reserve_checkpoint(self, request_id: str, query_start: int, query_end: int,
                           prefill_end: int) -> None:
        """Record this allocation's checkpoint (or that it has none)."""
        found = self.checkpoint_for(request_id, query_start, query_end, prefill_end)
        if found is None:
            self.checkpoints.pop(request_id, None)
        else:
            self.checkpoints[request_id] = found

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        # Sparse retention keeps some states only (MRET-1). A checkpoint block
        # holds the state at its checkpoint position, never by its full-block
        # key (MCKPT-3): ``publish_checkpoint`` keys it afterwards, or not (MCKPT-5).
        mask = retention_mask(self, request, num_cached, num_full)
        found = self.caching_checkpoint
        if found is None:
            return mask
        column = found[1]
        if not num_cached <= column < num_full:
            return mask
        mask = [True] * (num_full - num_cached) if mask is None else list(mask)
        mask[column - num_cached] = False
        return mask

    # -- allocation -----------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int,
                                   num_main_tokens: int, num_external_computed_tokens: int = 0) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_this_step:
            # ALLOC-4: more than the pool holds, so the allocation is refused this step.
            return self.block_pool.num_blocks + 1
        if self.mode != "align":
            with_drafts = num_tokens + self.block_size * self.num_speculative_blocks
            return super().get_num_blocks_to_allocate(request_id, with_drafts, new_computed_blocks,
                                                      num_total_computed_tokens, num_main_tokens,
                                                      num_external_computed_tokens)
        # align: lookahead tokens get no state blocks (draft models have no
        # Mamba layers), and at most one state block (plus the speculative
        # ones on the first allocation) is added per step.
        required = rules.cdiv(num_main_tokens, self.block_size) + self.num_speculative_blocks
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = required - len(new_computed_blocks) - held
        if num_new > 0:
            num_new = 1 if request_id in self.given_state else 1 + self.num_speculative_blocks
        # A hit ending inside a block (or a producer's published tail) takes
        # one more block: the copy-on-write destination (MPART-2).
        local = num_total_computed_tokens - num_external_computed_tokens
        if self.partial_hits and (request_id in self.partial_hit or (
                new_computed_blocks and not num_external_computed_tokens and local % self.block_size)):
            num_new = max(num_new, 0) + 1
        # (A prefill checkpoint's extra block is counted by the coordinator,
        # ``checkpoint_for``: a chunk that reserves one always needs two state blocks.)
        # A new request's externally computed tokens get blocks at admission
        # (``allocate_external``) before the state blocks: count them too, or
        # the allocation could run dry halfway (D-MAMBA-5).
        external = 0
        if request_id not in self.req_to_blocks and num_external_computed_tokens > 0:
            skipped = self.skipped_tokens(num_total_computed_tokens) // self.block_size
            external = rules.num_new_blocks_needed(num_total_computed_tokens, self.block_size,
                                                   max(skipped, len(new_computed_blocks)))
        evictable = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null)
        return max(num_new, 0) + external + evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[KVCacheBlock]:
        if self.mode != "align":
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks, num_main_tokens)
        blocks = self.req_to_blocks[request_id]
        spec_blocks = self.num_speculative_blocks
        required = rules.cdiv(num_main_tokens, self.block_size) + spec_blocks
        checkpoint = int(request_id in self.checkpoints)
        partial = self.partial_hit.pop(request_id, None)
        if required <= len(blocks) and not checkpoint and partial is None:
            # Holding its blocks already (a connector's, at admission) still
            # makes the request a running one, as vLLM 0.33 marks it (D-API-45).
            self.given_state.add(request_id)
            return []
        previous_len = len(blocks)
        given_before = request_id in self.given_state
        copied: list[KVCacheBlock] = []
        if partial is not None:
            destination = self._copy_on_write(request_id, partial, given_before)
            if destination is not None and not given_before:
                copied.append(destination)
        if given_before:
            # The running state sits just before the speculative blocks.
            self.last_state_block[request_id] = previous_len - 1 - spec_blocks
        elif previous_len > 0:
            # A hit: its last block holds the state to continue from.
            self.last_state_block[request_id] = previous_len - 1
        # A reserved checkpoint column is not padded: it gets a real block.
        num_padded = required - spec_blocks - 1 - checkpoint
        blocks.extend([self.block_pool.null_block] * max(0, num_padded - previous_len))
        if given_before:
            # Move last step's speculative blocks past the padding so they are reused.
            for index in range(previous_len - spec_blocks, previous_len):
                if index >= num_padded:
                    break
                blocks.append(blocks[index])
                blocks[index] = self.block_pool.null_block
        blocks.extend(self.block_pool.get_new_blocks(max(0, required - len(blocks))))
        self.given_state.add(request_id)
        return copied + blocks[previous_len:]

    def _copy_on_write(self, request_id: str, partial: tuple[int, KVCacheBlock],
                       given_before: bool) -> KVCacheBlock | None:
        """Take the copy's destination and queue ``(source, destination)``;
        both endpoints keep one retention reference until the copy is taken
        and released (MPART-3). A new request's hit moves onto the copy (the
        source stays shared); a running producer keeps writing its own block,
        so the published key moves to the copy instead (MPART-4). Returns the
        destination (new blocks of the request when it moved onto it)."""
        column, source = partial
        blocks = self.req_to_blocks[request_id]
        if blocks[column] is not source:
            return None  # the published state was released since: nothing to copy
        destination = self.block_pool.get_new_blocks(1)[0]
        if given_before:
            move_key(self.block_pool, source, destination)
            source.ref_cnt += 1  # the retention: the request keeps its own
            if destination.block_hash is not None:
                # Filled only by this step's copy: no hit on it this step.
                self.cached_this_step.add(destination.block_hash)
            tail = self.producer_tail.pop(request_id, None)
            if tail is not None and tail[0] is source:
                # The copy keeps the producer's boundary state: offer it (MOFF-2).
                self.offers.append((request_id, destination, tail[1]))
        else:
            # The hit reference on ``source`` becomes its retention.
            blocks[column] = destination
            destination.ref_cnt += 1
        self.copies.append((source, destination))
        return destination

    def take_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The queued copies, oldest first; the queue is emptied (their
        retention references now belong to the caller)."""
        copies, self.copies = self.copies, []
        return copies

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, num_total_computed_tokens)
        if self.mode != "align":
            return
        num_computed = num_total_computed_tokens  # settled basis (D-MAMBA-3)
        last = self.last_state_block.get(request_id)
        if last is not None and last < rules.cdiv(num_computed, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if not blocks[last].is_null:
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self.block_pool.null_block

    def admission_blocks(self, num_tokens: int) -> int:
        """The running state and the draft states, however long the request."""
        return 1 + self.num_speculative_blocks

    # -- caching and freeing ------------------------------------------------------------

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        if self.mode == "none":
            return
        before = self.num_cached_blocks[request_id]
        self.caching_checkpoint = self.checkpoints.get(request_id)
        try:
            super().cache_blocks(request, block_hashes, request_id, num_tokens)
        finally:
            self.caching_checkpoint = None
        if self.mode == "align":
            publish_checkpoint(self, request, request_id)
        after = self.num_cached_blocks[request_id]
        for position in range(before, after):
            block = self.req_to_blocks[request_id][position]
            if not block.is_null and block.block_hash is not None:
                self.cached_this_step.add(block.block_hash)
                if self.mode == "align":
                    # The tokens its key covers: a checkpoint's are its position (MOFF-1).
                    self.offers.append((request_id, block, block.key_tokens))
        if self.sub_block_hits and self.mode == "align":
            publish_resume_state(self, request, request_id, num_tokens)

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        super().admit(request_id, new_computed_blocks, num_local_computed_tokens,
                      num_external_computed_tokens)
        if (self.partial_hits and new_computed_blocks and not num_external_computed_tokens
                and num_local_computed_tokens % self.block_size):
            # The hit ends inside its state block: the request copies it
            # before writing (MPART-2); once full, the copy is cached again.
            column = num_local_computed_tokens // self.block_size
            self.partial_hit[request_id] = (column, self.req_to_blocks[request_id][column])
            self.num_cached_blocks[request_id] = column

    def take_offers(self) -> list[tuple[str, KVCacheBlock, int]]:
        """The boundary states offered since the last call, oldest first."""
        offers, self.offers = self.offers, []
        return offers

    def finalize_partial_tail(self, request_id: str, num_computed_tokens: int,
                              num_in_flight_tokens: int) -> tuple[KVCacheBlock, int] | None:
        """A finishing producer's uncopied tail (MTAIL-1), consumed."""
        return finalize_partial_tail(self, request_id, num_computed_tokens, num_in_flight_tokens)

    def release(self, request_id: str) -> None:
        # Its blocks go back to the pool: an offer not yet taken would name a
        # block another request may be handed next (MOFF-1).
        self.offers = [offer for offer in self.offers if offer[0] != request_id]
        self.checkpoints.pop(request_id, None)
        self.partial_hit.pop(request_id, None)
        self.published_tail = {entry for entry in self.published_tail if entry[0] != request_id}
        self.producer_tail.pop(request_id, None)
        self.given_state.discard(request_id)
        self.last_state_block.pop(request_id, None)
        super().release(request_id)

    def new_step_starts(self) -> None:
        self.cached_this_step.clear()
