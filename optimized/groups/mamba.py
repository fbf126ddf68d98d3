"""Mamba (state-space) layers: one running state per request instead of
per-token KV (spec/managers.md, MAMBA-1, MAMBA-2).

Modes (``MambaSpec.mamba_cache_mode``):

- ``"none"``: the state is never cached; a hit can only be empty.
- ``"all"``: every full block's state is cached; a hit of ``L`` tokens needs
  only the state block ending at ``L`` (``[N, ..., N, state]``).
- ``"align"``: the state lives in the last block(s) of the request, copied
  forward each step; the previous step's block is released once the copy no
  longer needs it. Worked example (block 4, one speculative block, 8 tokens
  per step): ``[N, 1, 2]`` -> ``[N, 1, N, 2, 3]`` -> ``[N, N, N, 2, N, 3, 4]``
  (last step's speculative block moves past the padding to be reused).

``num_speculative_blocks`` extra blocks hold draft states (MTP/EAGLE). A
state cached during a step cannot serve a hit in that same step (its
contents are written by the step): such an allocation is refused until
``new_step_starts``. The EAGLE rule does not apply to Mamba.

Prefill checkpoints (align mode, ``MambaSpec.has_prefill_checkpoints``): a
chunk may keep a real block at the worker's checkpoint column instead of a
null one, for the state the worker exports at a hash boundary inside the
chunk (spec/mamba.md, MCKPT-1..4).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.mamba_partial import move_key
from pagedkv.optimized.groups.mamba_publish import (
    finalize_partial_tail,
    publish_checkpoint,
    publish_resume_state,
    retention_mask,
)
from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.optimized.rules.mamba_checkpoint_rules import checkpoint_column, checkpoint_exportable, checkpoint_position
from pagedkv.optimized.rules.mamba_partial_rules import state_key
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import BlockHash

__all__ = ["MambaManager"]


class MambaManager(SingleTypeManager):
    """One Mamba group; see the module docstring for the modes."""

    __slots__ = ("mode", "num_speculative_blocks", "cached_this_step", "last_state_block",
                 "given_state", "checkpoints", "has_checkpoints", "cache_hit_alignment_tokens",
                 "hash_block_size", "drop_eagle_checkpoint",
                 "caching_checkpoint", "offers", "partial_hits", "partial_hit", "copies",
                 "published_tail", "caching_end", "replay_alignment", "producer_tail", "sub_block_hits",
                 "shared_prefix_checkpoint")

    uses_eagle_rule = False

    def _setup(self) -> None:
        spec = self.kv_cache_spec
        assert isinstance(spec, MambaSpec)
        self.mode = spec.mamba_cache_mode
        self.num_speculative_blocks = spec.num_speculative_blocks
        # Raw hashes this group cached during the current step (the group
        # id is implied: one manager, one group).
        self.cached_this_step: set[BlockHash] = set()
        # align mode: index of the state block the previous step wrote, and
        # the requests that have been given state blocks at least once.
        self.last_state_block: dict[str, int] = {}
        self.given_state: set[str] = set()
        # Prefill checkpoints: request -> (position, column) of its latest
        # allocation. The coordinator sets the alignment, the hash block
        # size and whether EAGLE moves checkpoints one unit down.
        self.checkpoints: dict[str, tuple[int, int]] = {}
        self.has_checkpoints = self.enable_caching and spec.has_prefill_checkpoints
        self.cache_hit_alignment_tokens = self.alignment
        # The model's alignment, where the prompt's replay positions fall
        # (D-MAMBA-35); sub-block hits may later lower ``alignment`` itself.
        self.replay_alignment = self.alignment
        self.hash_block_size = 1
        self.drop_eagle_checkpoint = False
        # The checkpoint of the request ``cache_blocks`` is caching, for ``cache_mask``.
        self.caching_checkpoint: tuple[int, int] | None = None
        # Boundary states offered to a KV connector until taken (MOFF-1):
        # request -> its (block, tokens) oldest first, requests in the order
        # of their first offer since the last take. Keyed by request so a
        # release drops its own offers in O(1), not by scanning every
        # request's (an engine that never drains them, D-PERF-36).
        self.offers: dict[str, list[tuple[int, int]]] = {}
        # Sub-block hits (MPART-1..4), switched on by the coordinator: hits
        # are looked up on the hash-block hashes; ``partial_hit`` is the
        # (column, source) a request copies on its next allocation,
        # ``copies`` the queued (source, destination) pairs, each endpoint
        # holding one retention reference until taken and released.
        self.partial_hits = False
        self.partial_hit: dict[str, tuple[int, int]] = {}
        self.copies: list[tuple[int, int]] = []
        # (request, boundary) pairs published inside a block (once each, MPART-4, MPART-6).
        self.published_tail: set[tuple[str, int]] = set()
        # Sub-block hits on for the model: resume states are published
        # (MPART-4..6), the observed junction too with ``shared_prefix_checkpoint``.
        self.sub_block_hits = False
        self.shared_prefix_checkpoint = False
        # A producer's published tail not yet handed over (MTAIL-1): request -> (block, boundary).
        self.producer_tail: dict[str, tuple[int, int]] = {}
        # The unaligned end of the caching call in progress (set by the coordinator).
        self.caching_end = -1

    # ---------------------------------------------------------------- hits

    def first_hit_block(self, length: int) -> int:
        """Only the state block ending at ``L``. Cost: O(1)."""
        return max(0, length // self.block_size - 1)

    def longest_hit(self, view: Sequence[BlockHash], bound: int, max_length: int) -> int:
        """See the base class; mode ``none`` never hits. Cost: O(aligned
        positions looked up between the bound and the result)."""
        if self.mode == "none":
            return 0
        if self.partial_hits:
            # ``view`` holds the hash-block hashes: step one hash block down
            # until the state after ``length`` tokens is cached (MPART-1).
            step = self.hash_block_size
            length = bound // step * step
            while length > 0 and self._state_at(view, length) is None:
                length -= step
            return length
        return super().longest_hit(view, bound, max_length)

    def hit_blocks(self, view: Sequence[BlockHash], length: int, max_length: int | None = None) -> list[int]:
        """See the base class; with sub-block hits, the state block of the
        hit after its padding. Cost: O(L / b)."""
        if not self.partial_hits or length == 0:
            return super().hit_blocks(view, length)
        state = self._state_at(view, length)
        assert state is not None
        return [0] * (-(-length // self.block_size) - 1) + [state]

    def _state_at(self, fine_hashes: Sequence[BlockHash], length: int) -> int | None:
        key = state_key(fine_hashes, length, self.hash_block_size, self.block_size)
        if key is None:
            return None
        found: int | None = self.block_pool.cached_by_group[self.group_id].get(key)
        return found

    def skipped_tokens(self, num_computed: int) -> int:
        """Only the state after the last computed token is needed. Cost: O(1)."""
        return num_computed - 1

    def released_tokens(self, num_total_computed_tokens: int) -> int:
        """The count is on the settled basis already (D-API-14): no further
        discount for speculative tokens (D-MAMBA-3). Cost: O(1)."""
        return self.skipped_tokens(num_total_computed_tokens)

    # ------------------------------------------------ prefill checkpoints

    def checkpoint_for(self, request_id: str, query_start: int, query_end: int,
                       prefill_end: int) -> tuple[int, int] | None:
        """The (position, column) the chunk ``[query_start, query_end)``
        reserves, or ``None`` (MCKPT-1). Cost: O(1)."""
        if not self.has_checkpoints or (self.retention_interval == 0 and query_end < prefill_end):
            return None
        block_size = self.block_size
        column = checkpoint_column(query_end, block_size)
        if column < 0:
            return None
        position = checkpoint_position(query_end, self.cache_hit_alignment_tokens,
                                       self.drop_eagle_checkpoint, self.hash_lookahead_tokens())
        spec = self.kv_cache_spec
        assert isinstance(spec, MambaSpec)
        if not checkpoint_exportable(query_start=query_start, query_end=query_end, position=position,
                                     hash_block_size=self.hash_block_size, block_size=block_size,
                                     export_alignment=spec.prefill_checkpoint_alignment):
            return None
        blocks = self.req_to_blocks.get(request_id)
        if (blocks is None or column >= len(blocks) or not blocks[column]
                or (column >= len(blocks) - self.num_speculative_blocks
                    and request_id in self.given_state)):
            return position, column
        return None

    def hash_lookahead_tokens(self) -> int:
        """Tokens past a block each block hash covers (lookahead hashing,
        spec/hashing.md): a checkpoint keeps them inside the prompt."""
        return self.block_pool.num_hash_lookahead_tokens

    def reserve_checkpoint(self, request_id: str, query_start: int, query_end: int,
                           prefill_end: int) -> None:
        """Record this allocation's checkpoint, or forget the last one. Cost: O(1)."""
        found = self.checkpoint_for(request_id, query_start, query_end, prefill_end)
        if found is not None:
            self.checkpoints[request_id] = found
        elif self.checkpoints:
            self.checkpoints.pop(request_id, None)

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        """The states retention keeps (MRET-1), less a checkpoint column,
        never keyed by its full-block key (MCKPT-3):
        ``publish_checkpoint`` keys it at its position, or not (MCKPT-5).
        Cost: O(1) dense without a checkpoint, else O(blocks)."""
        mask = retention_mask(self, request, num_cached, num_full)
        found = self.caching_checkpoint
        if found is None:
            return mask
        column = found[1]
        if column < num_cached or column >= num_full:
            return mask
        result = [True] * (num_full - num_cached) if mask is None else list(mask)
        result[column - num_cached] = False
        return result

    # ---------------------------------------------------------- allocation

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int],
                                   num_total_computed_tokens: int, num_main_tokens: int,
                                   num_external_computed_tokens: int = 0) -> int:
        """As the base class, with the speculative blocks; refused (more
        than the pool holds) when the hit's state was cached this step; in
        align mode at most one state block (plus the speculative ones on the
        first allocation) per step. Cost: O(len(new_computed_blocks) + 1)."""
        pool = self.block_pool
        if new_computed_blocks and pool.block_hashes[new_computed_blocks[-1]] in self.cached_this_step:
            return pool.num_blocks + 1  # ALLOC-4: the Mamba step rule refuses
        if self.mode != "align":
            with_drafts = num_tokens + self.block_size * self.num_speculative_blocks
            demand: int = super().get_num_blocks_to_allocate(
                request_id, with_drafts, new_computed_blocks, num_total_computed_tokens, num_main_tokens,
                num_external_computed_tokens)
            return demand
        # Lookahead tokens get no state blocks (draft models have no Mamba layers).
        required = -(-num_main_tokens // self.block_size) + self.num_speculative_blocks
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = required - len(new_computed_blocks) - held
        if num_new > 0:
            num_new = 1 if request_id in self.given_state else 1 + self.num_speculative_blocks
        # A hit ending inside its block (or a producer's published tail)
        # takes the copy-on-write destination too (MPART-2).
        if self.partial_hits and (request_id in self.partial_hit or (
                new_computed_blocks and not num_external_computed_tokens
                and (num_total_computed_tokens - num_external_computed_tokens) % self.block_size)):
            num_new = max(num_new, 0) + 1
        # A new request's externally computed tokens get blocks at admission
        # (``allocate_external``) before the state blocks: count them too, or
        # the allocation could run dry halfway (D-MAMBA-5).
        external = 0
        if num_external_computed_tokens > 0 and request_id not in self.req_to_blocks:
            skipped = self.skipped_tokens(num_total_computed_tokens) // self.block_size
            external = max(-(-num_total_computed_tokens // self.block_size)
                           - max(skipped, len(new_computed_blocks)), 0)
        ref = pool.ref_counts
        evictable = sum(1 for block in new_computed_blocks if block and ref[block] == 0)
        return max(num_new, 0) + external + evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[int]:
        """See the module docstring (align mode shuffles the speculative
        blocks past the padding). Cost: O(new blocks + padding)."""
        if self.mode != "align":
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                num_main_tokens)
        blocks = self.req_to_blocks[request_id]
        spec_blocks = self.num_speculative_blocks
        required = -(-num_main_tokens // self.block_size) + spec_blocks
        checkpoint = 1 if request_id in self.checkpoints else 0
        partial = self.partial_hit.pop(request_id, None) if self.partial_hit else None
        if required <= len(blocks) and not checkpoint and partial is None:
            self.given_state.add(request_id)  # a running request from now on (D-API-45)
            return []
        previous_len = len(blocks)
        given_before = request_id in self.given_state
        copied: list[int] = []
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
        # A reserved checkpoint column gets a real block, not padding.
        num_padded = required - spec_blocks - 1 - checkpoint
        if num_padded > previous_len:
            blocks.extend([0] * (num_padded - previous_len))
        if given_before:
            # Move last step's speculative blocks past the padding so they are reused.
            for index in range(previous_len - spec_blocks, min(previous_len, num_padded)):
                blocks.append(blocks[index])
                blocks[index] = 0
        missing = required - len(blocks)
        if missing > 0:
            blocks.extend(self.block_pool.get_new_blocks(missing))
        self.given_state.add(request_id)
        return copied + blocks[previous_len:] if copied else blocks[previous_len:]

    def _copy_on_write(self, request_id: str, partial: tuple[int, int], given_before: bool) -> int | None:
        """Queue ``(source, destination)`` with a retention reference on each
        (MPART-3): a new request's hit moves onto the copy; a running
        producer keeps its block and its published key moves to the copy
        (MPART-4). Returns the destination. Cost: O(1)."""
        column, source = partial
        pool = self.block_pool
        blocks = self.req_to_blocks[request_id]
        if blocks[column] != source:
            return None  # the published state was released since: nothing to copy
        destination = pool.get_new_blocks(1)[0]
        assert source
        if given_before:
            move_key(pool, source, destination)
            pool._ref[source] += 1
            block_hash = pool._hash[destination]
            if block_hash is not None:
                self.cached_this_step.add(block_hash)  # filled by this step's copy
            tail = self.producer_tail.pop(request_id, None) if self.producer_tail else None
            if tail is not None and tail[0] == source:
                self._offer(request_id, destination, tail[1])  # the copy keeps it (MOFF-2)
        else:
            blocks[column] = destination
            pool._ref[destination] += 1
        self.copies.append((source, destination))
        return destination

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued copies, oldest first; emptied. Cost: O(1)."""
        copies, self.copies = self.copies, []
        return copies

    def admit(self, request_id: str, new_computed_blocks: Sequence[int],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """See the base class; a hit ending inside its state block is
        recorded for copy-on-write (MPART-2). Cost: as the base class."""
        super().admit(request_id, new_computed_blocks, num_local_computed_tokens,
                      num_external_computed_tokens)
        if (self.partial_hits and new_computed_blocks and not num_external_computed_tokens
                and num_local_computed_tokens % self.block_size):
            column = num_local_computed_tokens // self.block_size
            self.partial_hit[request_id] = (column, self.req_to_blocks[request_id][column])
            self.num_cached_blocks[request_id] = column

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int) -> None:
        """Release all but the live state (:meth:`released_tokens`) and, in
        align mode, last step's state once copied. Cost: O(blocks released + 1)."""
        super().remove_skipped_blocks(request_id, num_total_computed_tokens)
        if self.mode != "align":
            return
        num_computed = num_total_computed_tokens  # settled basis (D-MAMBA-3)
        last = self.last_state_block.get(request_id)
        if last is not None and last < -(-num_computed // self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            block = blocks[last]
            if block:
                blocks[last] = 0
                self.block_pool.free_held((block,))

    # ------------------------------------------------- caching and freeing

    def cache_blocks(self, request: HashedRequest, view: Sequence[BlockHash] | None,
                     request_id: str, num_tokens: int) -> None:
        """As the base class (never in mode ``none``); remembers the states
        cached in this step (MAMBA-2). Cost: O(blocks newly cached)."""
        if self.mode == "none":
            return
        before = self.num_cached_blocks[request_id]
        self.caching_checkpoint = self.checkpoints.get(request_id) if self.checkpoints else None
        try:
            super().cache_blocks(request, view, request_id, num_tokens)
        finally:
            self.caching_checkpoint = None
        if self.checkpoints and self.mode == "align":
            publish_checkpoint(self, request, request_id)
        hashes = self.block_pool.block_hashes
        key_tokens = self.block_pool._key_tokens
        added = self.cached_this_step.add
        offered: list[tuple[int, int]] | None = None
        if self.mode == "align":
            offered = self.offers.get(request_id)
            if offered is None:
                offered = []
        blocks = self.req_to_blocks[request_id]
        for position in range(before, self.num_cached_blocks[request_id]):
            block = blocks[position]
            block_hash = hashes[block]
            if block and block_hash is not None:
                added(block_hash)
                if offered is not None:
                    offered.append((block, key_tokens[block]))  # a checkpoint's: its position
        if offered and request_id not in self.offers:
            self.offers[request_id] = offered
        if self.sub_block_hits:
            publish_resume_state(self, request, request_id, num_tokens)

    def _offer(self, request_id: str, block: int, num_tokens: int) -> None:
        """Offer ``block``'s boundary state (``num_tokens`` tokens) to a KV connector. Cost: O(1)."""
        offered = self.offers.get(request_id)
        if offered is None:
            self.offers[request_id] = [(block, num_tokens)]
        else:
            offered.append((block, num_tokens))

    def take_offers(self) -> list[tuple[str, int, int]]:
        """The boundary states offered since the last call: ``(request,
        block, tokens)``, request by request in the order of their first
        offer, each request's oldest first. Cost: O(offers)."""
        offers, self.offers = self.offers, {}
        return [(request_id, block, num_tokens) for request_id, offered in offers.items()
                for block, num_tokens in offered]

    def finalize_partial_tail(self, request_id: str, num_computed_tokens: int,
                              num_in_flight_tokens: int) -> tuple[int, int] | None:
        """A finishing producer's uncopied tail (MTAIL-1), consumed. Cost: O(1)."""
        return finalize_partial_tail(self, request_id, num_computed_tokens, num_in_flight_tokens)

    def release(self, request_id: str) -> None:
        """Forget the request's state bookkeeping, then release its blocks.
        Cost: O(blocks held + offers pending)."""
        if self.offers:  # the blocks go back to the pool: drop their offers (MOFF-1)
            self.offers.pop(request_id, None)
        self.checkpoints.pop(request_id, None)
        if self.partial_hit:
            self.partial_hit.pop(request_id, None)
        if self.published_tail:
            self.published_tail = {entry for entry in self.published_tail if entry[0] != request_id}
        if self.producer_tail:
            self.producer_tail.pop(request_id, None)
        self.given_state.discard(request_id)
        self.last_state_block.pop(request_id, None)
        super().release(request_id)

    def new_step_starts(self) -> None:
        """States cached so far may serve hits from now on. Cost: O(1) amortised."""
        self.cached_this_step.clear()
