"""Managers whose attention reads a bounded window: sliding window and
chunked local attention (spec/managers.md). Both release blocks that fall
out of the window and pad their place with the null block (SKIP-1)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference import rules
from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec

__all__ = ["SlidingWindowManager", "ChunkedLocalAttentionManager"]


class _WindowedManager(SingleTypeManager):
    """Blocks out of the window are recycled, so a whole request never holds
    more than the spec's admission cap at once (spec/managers.md §8; SWA-1,
    CHUNK-1)."""

    def admission_blocks(self, num_tokens: int) -> int:
        needed = rules.cdiv(num_tokens, self.block_size)
        return needed if self.admission_cap is None else min(needed, self.admission_cap)

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        # SKIP-1 (a): windowed groups hold a null prefix, then distinct real blocks.
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
    def window(self) -> int:
        assert isinstance(self.kv_cache_spec, SlidingWindowSpec)
        return self.kv_cache_spec.sliding_window

    @property
    def contiguous_blocks(self) -> int:
        """``n``: blocks a hit must have cached right before its end."""
        return rules.contiguous_blocks_for_hit(self.window, self.block_size)

    def skipped_tokens(self, num_computed: int) -> int:
        # The extra retained tokens extend the window's trailing edge (D-SWA-13).
        assert isinstance(self.kv_cache_spec, SlidingWindowSpec)
        return rules.sliding_window_skipped_tokens(num_computed, self.kv_cache_spec.retained_window)

    def hit_span(self, length: int) -> tuple[int, int]:
        end = length // self.block_size
        return max(0, end - self.contiguous_blocks), end

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        # Only blocks that can end a hit at some aligned length are worth a
        # cache entry (they would otherwise push out useful ones); with
        # retention, only those ending a kept boundary (spec/managers.md §4).
        if self.retention_interval is None and self.alignment == self.block_size:
            return None
        shift = 1 if self.use_eagle else 0
        return rules.reachable_block_mask(num_cached, num_full, self.block_size, self.alignment,
                                          self.contiguous_blocks + shift, shift, self.retention_interval,
                                          self.kept_boundaries(request))

    def kept_boundaries(self, request: HashedRequest) -> tuple[int, ...]:
        """The positions whose window tail sparse retention keeps: the
        prompt's replay positions and the shared-prefix junction the engine
        pinned (with EAGLE also one block below it: a sibling diverging
        right after the junction cannot use the block past it as its peek)."""
        prompt_tokens = getattr(request, "num_prompt_tokens", None)
        boundaries = list(rules.replay_boundaries(prompt_tokens, self.alignment, self.replay_eagle)
                          if isinstance(prompt_tokens, int) else ())
        junction = getattr(request, "shared_prefix_boundary", 0)
        if isinstance(junction, int) and junction > 0:
            boundaries.append(junction)
            if self.use_eagle and junction >= self.block_size:
                boundaries.append(junction - self.block_size)
        return tuple(boundaries)


class ChunkedLocalAttentionManager(_WindowedManager):
    """Chunked local attention with chunks of ``c`` tokens: a token reads only
    the earlier tokens of its own chunk. A hit of ``L`` tokens needs the
    blocks from the start of ``L``'s chunk up to ``L`` cached; blocks before
    the chunk are served as null blocks."""

    @property
    def chunk_size(self) -> int:
        assert isinstance(self.kv_cache_spec, ChunkedLocalAttentionSpec)
        return self.kv_cache_spec.attention_chunk_size

    def skipped_tokens(self, num_computed: int) -> int:
        return rules.chunked_local_skipped_tokens(num_computed, self.chunk_size)

    def hit_span(self, length: int) -> tuple[int, int]:
        chunk_start = rules.chunked_local_skipped_tokens(length, self.chunk_size)
        return chunk_start // self.block_size, length // self.block_size
