"""Mamba (spec/managers.md §6, MAMBA-1, MAMBA-2): one running state per
request instead of per-token KV. Modes (``MambaSpec.mamba_cache_mode``):
- ``"none"``: the state is never cached; a hit can only be empty.
- ``"all"``: every full block's state is cached; a hit of ``L`` tokens needs
  only the state block ending at ``L``.
- ``"align"``: the state lives in the last block(s) of the request, copied
  forward each step; the previous step's block is released once the copy no
  longer needs it.
``num_speculative_blocks`` extra blocks hold draft states (MTP/EAGLE). A
state cached during a step serves no hit in that step (MAMBA-2). Prefill
checkpoints, sub-block hits and publication are a feature
(``pagedkv.reference.features.mamba_states``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.reference import rules
from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import BlockHash, BlockHashWithGroupId

__all__ = ["MambaManager"]


class MambaManager(SingleTypeManager):
    """One Mamba group; see the module docstring for the modes."""

    uses_eagle_rule = False

    def __init__(self, kv_cache_spec: KVCacheSpec, **options: Any) -> None:
        super().__init__(kv_cache_spec, **options)
        assert isinstance(kv_cache_spec, MambaSpec)
        self.mode, self.num_speculative_blocks = kv_cache_spec.mamba_cache_mode, kv_cache_spec.num_speculative_blocks
        self.cached_this_step: set[BlockHashWithGroupId] = set()
        # align mode: index of the state block the previous step wrote, and
        # the requests that have been given state blocks at least once.
        self.last_state_block: dict[str, int] = {}
        self.given_state: set[str] = set()

    def hit_span(self, length: int) -> tuple[int, int]:
        end = length // self.block_size
        return max(0, end - 1), end

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        return length == 0 if self.mode == "none" else super().can_hit(block_hashes, length, max_length)

    def skipped_tokens(self, num_computed: int) -> int:
        return num_computed - 1  # only the state after the last computed token is read

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int,
                                   num_main_tokens: int, num_external_computed_tokens: int = 0) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_this_step:
            return self.block_pool.num_blocks + 1  # MAMBA-2: refused this step (ALLOC-4)
        if self.mode != "align":
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks, new_computed_blocks,
                num_total_computed_tokens, num_main_tokens, num_external_computed_tokens)
        # align: lookahead tokens get no state blocks (draft models have no
        # Mamba layers); at most one state block (plus the speculative ones
        # on the first allocation) is added per step.
        required = rules.cdiv(num_main_tokens, self.block_size) + self.num_speculative_blocks
        num_new = required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        if num_new > 0:
            num_new = 1 if request_id in self.given_state else 1 + self.num_speculative_blocks
        # A new request's external tokens get blocks at admission, before the
        # state blocks: count them too (D-MAMBA-5).
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
        return self.allocate_state_blocks(request_id, num_main_tokens)

    def allocate_state_blocks(self, request_id: str, num_main_tokens: int, *, real_column: bool = False,
                              always: bool = False) -> list[KVCacheBlock]:
        """align: the state blocks for ``num_main_tokens``, padding before
        them with null blocks. ``real_column``: the column before the state
        gets a real block too; ``always``: allocate even when the request
        holds enough blocks (both for the feature, MCKPT-1, MPART-2)."""
        blocks, spec_blocks = self.req_to_blocks[request_id], self.num_speculative_blocks
        required = rules.cdiv(num_main_tokens, self.block_size) + spec_blocks
        if required <= len(blocks) and not real_column and not always:
            # Holding its blocks already (a connector's) still makes the request running (D-API-45).
            self.given_state.add(request_id)
            return []
        previous_len, given_before = len(blocks), request_id in self.given_state
        if given_before:  # the running state sits just before the speculative blocks
            self.last_state_block[request_id] = previous_len - 1 - spec_blocks
        elif previous_len > 0:  # a hit: its last block holds the state to continue from
            self.last_state_block[request_id] = previous_len - 1
        num_padded = required - spec_blocks - 1 - int(real_column)
        blocks.extend([self.block_pool.null_block] * max(0, num_padded - previous_len))
        if given_before:
            # Move last step's speculative blocks past the padding so they are reused.
            for index in range(previous_len - spec_blocks, min(previous_len, num_padded)):
                blocks.append(blocks[index])
                blocks[index] = self.block_pool.null_block
        blocks.extend(self.block_pool.get_new_blocks(max(0, required - len(blocks))))
        self.given_state.add(request_id)
        return blocks[previous_len:]

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        # The count is on the settled basis already (D-API-14, D-MAMBA-3).
        super().remove_skipped_blocks(request_id, num_total_computed_tokens)
        last = self.last_state_block.get(request_id)
        if self.mode == "align" and last is not None and last < rules.cdiv(
                num_total_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if not blocks[last].is_null:
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self.block_pool.null_block

    def admission_blocks(self, num_tokens: int) -> int:
        return 1 + self.num_speculative_blocks  # the running state and the draft states

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        if self.mode == "none":
            return
        before = self.num_cached_blocks[request_id]
        super().cache_blocks(request, block_hashes, request_id, num_tokens)
        new = self.req_to_blocks[request_id][before:self.num_cached_blocks[request_id]]
        self.cached_this_step.update(block.block_hash for block in new if block.block_hash is not None)

    def release(self, request_id: str) -> None:
        self.given_state.discard(request_id)
        self.last_state_block.pop(request_id, None)
        super().release(request_id)

    def new_step_starts(self) -> None:
        self.cached_this_step.clear()
