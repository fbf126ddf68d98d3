"""Reference sliding window (R-SWA, ``RSWASpec``; spec/managers.md §2a,
D-SPEC-19): every later token reads the whole prompt and only the last
``rswa_window`` tokens generated after it. Hits and caching are full
attention's; what differs is that the blocks between the prompt and the
decode window (the *gap*) are released early, given the prompt length.

Worked example (block 4, window 4, prompt 6 tokens): with 17 tokens settled
the window starts at ``max(6, 17 - 4) = 13``; blocks ``cdiv(6, 4) = 2`` up to
``13 // 4 = 3`` (exclusive) lie in the gap: block 2 (tokens 8..11) becomes
null. Block 1 (tokens 4..7) holds prompt tokens and is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedkv.reference import rules
from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.hooks import Feature
from pagedkv.reference.single_type import FullAttentionManager, SingleTypeManager
from pagedkv.spec.attention_variants import RSWASpec

__all__ = ["RSWA", "RSWAManager"]


class RSWAManager(FullAttentionManager):
    """Full attention whose gap blocks are released once the decode window
    has moved past them (RSWA-1)."""

    def gap(self, num_prompt_tokens: int, num_settled_tokens: int) -> tuple[int, int]:
        """``(first, end)``: the block positions lying wholly between the
        prompt's last block and the decode window's start."""
        assert isinstance(self.kv_cache_spec, RSWASpec)
        window_start = max(num_prompt_tokens, num_settled_tokens - self.kv_cache_spec.rswa_window)
        return rules.cdiv(num_prompt_tokens, self.block_size), window_start // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Full attention skips nothing; the gap is released when the prompt
        length is known (RSWA-1)."""
        if num_prompt_tokens is None:
            super().remove_skipped_blocks(request_id, num_total_computed_tokens)
        else:
            self.remove_gap_blocks(request_id, num_total_computed_tokens, num_prompt_tokens)

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        # R-SWA: null blocks only where its gap was released (RSWA-1).
        real_ids = [block.block_id for block in blocks if not block.is_null]
        if len(set(real_ids)) != len(real_ids):
            return f"RSWA-1: request {request_id!r} holds a block twice: {[b.block_id for b in blocks]}"
        return None

    def remove_gap_blocks(self, request_id: str, num_settled_tokens: int, num_prompt_tokens: int) -> None:
        """Replace the gap's blocks by the null block and release them, last
        first, stopping at a null block (everything before it was released by
        an earlier call)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        first, end = self.gap(num_prompt_tokens, num_settled_tokens)
        released = []
        for index in range(min(end, len(blocks)) - 1, first - 1, -1):
            if blocks[index].is_null:
                break
            released.append(blocks[index])
            blocks[index] = self.block_pool.null_block
        self.block_pool.free_blocks(released)


class RSWA(Feature):
    """The R-SWA feature: the ``rswa`` manager kind (H1)."""

    def attention_types(self) -> Mapping[str, type[SingleTypeManager]]:
        return {"rswa": RSWAManager}
