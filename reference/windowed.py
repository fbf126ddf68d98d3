"""Sliding window and chunked local attention (spec/managers.md §4, §5):
blocks out of the window are released, their places nulled (SKIP-1)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference import rules
from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec

__all__ = ["SlidingWindowManager", "ChunkedLocalAttentionManager"]


class _WindowedManager(SingleTypeManager):
    """A whole request holds at most the admission cap at once (§8, SWA-1, CHUNK-1)."""

    def admission_blocks(self, num_tokens: int) -> int:
        needed = rules.cdiv(num_tokens, self.block_size)
        return needed if self.admission_cap is None else min(needed, self.admission_cap)

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        # SKIP-1 (a): a null prefix, then distinct real blocks.
        ids = [block.block_id for block in blocks]
        real = [block_id for block_id in ids if block_id != 0]
        if ids[len(ids) - len(real):] != real or len(set(real)) != len(real):
            return f"SKIP-1: request {request_id!r} group {self.group_id} holds {ids}"
        return None


class SlidingWindowManager(_WindowedManager):
    """Sliding window of ``w`` tokens: the next token reads the ``w - 1``
    tokens before it. A hit of ``L`` tokens needs the ``n = cdiv(w - 1, b)``
    blocks before ``L`` cached (all of them when ``L`` is shorter); blocks
    before those are served as null blocks."""

    @property
    def contiguous_blocks(self) -> int:
        """``n``: blocks a hit must have cached right before its end."""
        assert isinstance(self.kv_cache_spec, SlidingWindowSpec)
        return rules.contiguous_blocks_for_hit(self.kv_cache_spec.sliding_window, self.block_size)

    def skipped_tokens(self, num_computed: int) -> int:
        # The extra retained tokens extend the window's trailing edge (D-SWA-13).
        assert isinstance(self.kv_cache_spec, SlidingWindowSpec)
        return rules.sliding_window_skipped_tokens(num_computed, self.kv_cache_spec.retained_window)

    def hit_span(self, length: int) -> tuple[int, int]:
        end = length // self.block_size
        return max(0, end - self.contiguous_blocks), end


class ChunkedLocalAttentionManager(_WindowedManager):
    """Chunked local attention with chunks of ``c`` tokens: a token reads only
    the earlier tokens of its own chunk. A hit of ``L`` tokens needs the
    blocks from the start of ``L``'s chunk up to ``L`` cached; blocks before
    the chunk are served as null blocks."""

    def skipped_tokens(self, num_computed: int) -> int:
        assert isinstance(self.kv_cache_spec, ChunkedLocalAttentionSpec)
        return rules.chunked_local_skipped_tokens(num_computed, self.kv_cache_spec.attention_chunk_size)

    def hit_span(self, length: int) -> tuple[int, int]:
        return self.skipped_tokens(length) // self.block_size, length // self.block_size
