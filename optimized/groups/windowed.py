"""Managers whose attention reads a bounded window: sliding window and
chunked local attention (spec/managers.md). Both release blocks that fall
out of the window and pad their place with the null block (SKIP-1).

Worked example (sliding window 4, block size 2, 7 tokens computed): the
next token (position 7) reads positions 4-6, so tokens 0-3 are skipped
(``7 - 4 + 1 = 4``) and blocks 0 and 1 become null: ``[N, N, 3, 4]``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, SlidingWindowSpec

__all__ = ["SlidingWindowManager", "ChunkedLocalAttentionManager", "reachable_block_mask"]


class SlidingWindowManager(SingleTypeManager):
    """Sliding window of ``w`` tokens: the next token reads the ``w - 1``
    tokens before it. A hit of ``L`` tokens needs the ``n = cdiv(w - 1, b)``
    blocks before ``L`` cached (all of them when ``L`` is shorter); blocks
    before those are served as null blocks: window 8, block 4, a 16-token
    hit is ``[N, N, b2, b3]``."""

    __slots__ = ("window", "contiguous_blocks", "retained")

    def _setup(self) -> None:
        spec = self.kv_cache_spec
        assert isinstance(spec, SlidingWindowSpec)
        self.window = spec.sliding_window
        self.contiguous_blocks = -(-(self.window - 1) // self.block_size)
        self.retained = spec.retained_window  # window + extra retained tokens (D-SWA-13)

    def skipped_tokens(self, num_computed: int) -> int:
        """``max(0, n - (w + extra) + 1)``. Cost: O(1)."""
        skipped = num_computed - self.retained + 1
        return skipped if skipped > 0 else 0  # no max(): the decode fast path calls this per group

    def first_hit_block(self, length: int) -> int:
        """``max(0, L / b - n)``. Cost: O(1)."""
        return max(0, length // self.block_size - self.contiguous_blocks)

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        """Only blocks that can end a hit at some aligned length are worth a
        cache entry (others would push out useful ones); every block when
        the alignment is the block size and retention is dense. Cost:
        O(num_full - num_cached)."""
        retention = self.retention_interval
        if retention is None and self.alignment == self.block_size:
            return None
        shift = 1 if self.use_eagle else 0
        return reachable_block_mask(
            num_cached, num_full, self.block_size, self.alignment, self.contiguous_blocks + shift,
            shift, retention, () if retention is None else self._kept_boundaries(request))

    def _kept_boundaries(self, request: HashedRequest) -> list[int]:
        """Replay positions of the prompt (an exact resend resumes at
        ``P - 1``; with EAGLE one alignment unit below the resend's and a
        longer sibling's aligned ends) plus the shared-prefix junction the
        engine pinned (with EAGLE also one block below it). Cost: O(1)."""
        boundaries: list[int] = []
        prompt = getattr(request, "num_prompt_tokens", None)
        if isinstance(prompt, int) and prompt >= 1:
            if self.replay_eagle:  # the model's drafter, not this group's rule (D-SWA-14)
                unit = self.alignment
                resend = (prompt - 1) // unit * unit - unit
                extension = prompt // unit * unit - unit
                boundaries += [resend if resend > 0 else 0, extension if extension > 0 else 0]
            else:
                boundaries.append(prompt - 1)
        junction = getattr(request, "shared_prefix_boundary", 0)
        if isinstance(junction, int) and junction > 0:
            boundaries.append(junction)
            if self.use_eagle and junction >= self.block_size:
                boundaries.append(junction - self.block_size)
        return boundaries


class ChunkedLocalAttentionManager(SingleTypeManager):
    """Chunked local attention with chunks of ``c`` tokens: a token reads only
    the earlier tokens of its own chunk. A hit of ``L`` tokens needs the
    blocks from the start of ``L``'s chunk up to ``L`` cached; blocks before
    the chunk are null (chunk 8, block 4: a 12-token hit is ``[N, N, b2]``,
    a 16-token hit ``[N, N, N, N]`` with nothing looked up)."""

    __slots__ = ("chunk_size",)

    def _setup(self) -> None:
        spec = self.kv_cache_spec
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        self.chunk_size = spec.attention_chunk_size

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens before the current chunk: ``n // c * c``. Cost: O(1)."""
        return num_computed // self.chunk_size * self.chunk_size

    def first_hit_block(self, length: int) -> int:
        """The block where ``L``'s chunk starts. Cost: O(1)."""
        return length // self.chunk_size * self.chunk_size // self.block_size


def reachable_block_mask(start_block: int, end_block: int, block_size: int, alignment: int,
                         need: int, shift: int, retention_interval: int | None,
                         boundaries: Sequence[int]) -> list[bool] | None:
    """Which sliding-window blocks in ``[start_block, end_block)`` are worth
    caching: those among the ``need`` blocks before block ``L / b + shift``
    for some kept boundary ``L``. ``retention_interval``: ``None`` keeps a
    tail at every aligned boundary, ``0`` only the tails ending at
    ``boundaries`` (floored to the alignment), ``k > 0`` one tail per ``k``
    tokens plus those. ``None`` means every block (the tails overlap).

    Cost: O(end_block - start_block + len(boundaries) * need).
    """
    per_boundary = None if retention_interval == 0 else (
        alignment if retention_interval is None else retention_interval) // block_size
    if per_boundary is not None and need >= per_boundary:
        return None
    mask = [False] * len(range(start_block, end_block))
    if per_boundary is not None:
        keep_from = per_boundary - need
        for index in range(max(start_block, shift), end_block):
            if (index - shift) % per_boundary >= keep_from:
                mask[index - start_block] = True
    if retention_interval is not None:
        for boundary in boundaries:
            tail_end = boundary // alignment * alignment // block_size + shift
            for index in range(max(start_block, tail_end - need), min(end_block, tail_end)):
                mask[index - start_block] = True
    return mask
