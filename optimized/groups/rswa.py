"""Reference sliding window (R-SWA, ``RSWASpec``; spec/managers.md §2a,
D-SPEC-19): hits and caching as full attention; the blocks between the
prompt and the decode window (the gap) are released once the window has
moved past them. Block 4, window 4, prompt 6, 17 tokens settled: the window
starts at 13, so position 2 (tokens 8..11) is released.

No decode probe covers this class and a single R-SWA group does not take the
single-group fast path (``coordinator.py``), so its steps take the general
path, where the coordinator hands it the prompt length.
"""

from __future__ import annotations

from pagedkv.optimized.groups.single_type import FullAttentionManager
from pagedkv.spec.attention_variants import RSWASpec

__all__ = ["RSWAManager"]


class RSWAManager(FullAttentionManager):
    """Full attention with early release of gap blocks (RSWA-1)."""

    __slots__ = ("rswa_window",)

    holds_null_blocks = True  # released gap positions hold the null block

    def _setup(self) -> None:
        spec = self.kv_cache_spec
        assert isinstance(spec, RSWASpec)
        self.rswa_window = spec.rswa_window

    def remove_gap_blocks(self, request_id: str, num_settled_tokens: int, num_prompt_tokens: int) -> None:
        """Null and release positions ``cdiv(P, b)`` up to
        ``max(P, settled - window) // b`` (exclusive), last first, stopping at
        a null block. Cost: O(blocks released + 1)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        block_size = self.block_size
        first = -(-num_prompt_tokens // block_size)
        window_start = num_settled_tokens - self.rswa_window
        if window_start < num_prompt_tokens:
            window_start = num_prompt_tokens
        index = min(window_start // block_size, len(blocks)) - 1
        released: list[int] = []
        while index >= first and blocks[index]:
            released.append(blocks[index])
            blocks[index] = 0
            index -= 1
        if released:
            self.block_pool.free_held(released)
