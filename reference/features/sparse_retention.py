"""Sparse retention of sliding-window blocks (spec/managers.md §4,
D-SWA-11, D-SWA-13): a sliding-window group caches only the blocks that
can end a hit at some aligned length, and with ``retention_interval`` only
those ending a kept boundary, so useless entries do not push out useful
ones. The :class:`SparseRetention` feature swaps
:class:`RetainingSlidingWindowManager` in for the kernel's sliding-window
manager before any request (H2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.reference.hooks import Feature
from pagedkv.reference.windowed import SlidingWindowManager
from pagedkv.spec.hashing import HashedRequest

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["SparseRetention", "RetainingSlidingWindowManager", "replay_boundaries", "reachable_block_mask"]


def replay_boundaries(num_prompt_tokens: int, alignment: int, use_eagle: bool) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at,
    so sparse retention keeps the window tail ending there.

    An exact resend is capped at ``num_prompt_tokens - 1`` (its last token is
    recomputed for its logits). With EAGLE a hit drops its last block, so the
    reachable positions are one alignment unit below the resend's and a
    longer sibling's aligned ends (they differ only for an aligned prompt).
    An empty prompt has none.

    pre: num_prompt_tokens >= 0
    pre: alignment >= 1
    post: all(0 <= boundary < max(num_prompt_tokens, 1) for boundary in __return__)
    post: num_prompt_tokens >= 1 or __return__ == ()
    """
    if num_prompt_tokens < 1:
        return ()
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    resend = (num_prompt_tokens - 1) // alignment * alignment
    extension = num_prompt_tokens // alignment * alignment
    return tuple(sorted({max(resend - alignment, 0), max(extension - alignment, 0)}))


def reachable_block_mask(start_block: int, end_block: int, block_size: int, alignment: int,
                         need: int, shift: int, retention_interval: int | None,
                         boundaries: tuple[int, ...]) -> list[bool] | None:
    """Which sliding-window blocks in ``[start_block, end_block)`` are worth
    caching: only those that can end a hit at some aligned length. ``None``
    means every block is worth it.

    A hit of length ``L`` (a multiple of ``alignment``) uses the ``need``
    blocks before block ``L / block_size + shift`` (``shift`` is 1 with EAGLE,
    whose hit peeks one block further). ``retention_interval`` thins the
    kept tails: ``None`` keeps one at every aligned boundary, ``0`` only the
    tails ending at ``boundaries`` (token positions, floored to the
    alignment: the prompt's replay positions and a shared-prefix junction),
    ``k > 0`` one per ``k``-token segment plus those tails.

    pre: 0 <= start_block <= end_block
    pre: block_size >= 1 and alignment >= block_size and alignment % block_size == 0
    pre: need >= 1 and shift in (0, 1)
    pre: retention_interval is None or (retention_interval >= 0 and retention_interval % alignment == 0)
    pre: all(boundary >= 0 for boundary in boundaries)
    post: __return__ is None or len(__return__) == end_block - start_block
    """
    per_boundary = None if retention_interval == 0 else (
        alignment if retention_interval is None else retention_interval) // block_size
    if per_boundary is not None and need >= per_boundary:
        return None
    mask = [False for _ in range(start_block, end_block)]
    if per_boundary is not None:
        for index in range(max(start_block, shift), end_block):
            if (index - shift) % per_boundary >= per_boundary - need:
                mask[index - start_block] = True
    if retention_interval is not None:
        for boundary in boundaries:
            tail_end = boundary // alignment * alignment // block_size + shift
            for index in range(max(start_block, tail_end - need), min(end_block, tail_end)):
                mask[index - start_block] = True
    return mask


class RetainingSlidingWindowManager(SlidingWindowManager):
    """A sliding-window group that caches only the blocks worth a cache entry."""

    def cache_mask(self, request: HashedRequest, num_cached: int, num_full: int) -> list[bool] | None:
        # Only blocks that can end a hit at some aligned length are worth a
        # cache entry (they would otherwise push out useful ones); with
        # retention, only those ending a kept boundary (spec/managers.md §4).
        if self.retention_interval is None and self.alignment == self.block_size:
            return None
        shift = 1 if self.use_eagle else 0
        return reachable_block_mask(num_cached, num_full, self.block_size, self.alignment,
                                          self.contiguous_blocks + shift, shift, self.retention_interval,
                                          self.kept_boundaries(request))

    def kept_boundaries(self, request: HashedRequest) -> tuple[int, ...]:
        """The positions whose window tail sparse retention keeps: the
        prompt's replay positions and the shared-prefix junction the engine
        pinned (with EAGLE also one block below it: a sibling diverging
        right after the junction cannot use the block past it as its peek)."""
        prompt_tokens = getattr(request, "num_prompt_tokens", None)
        boundaries = list(replay_boundaries(prompt_tokens, self.alignment, self.replay_eagle)
                          if isinstance(prompt_tokens, int) else ())
        junction = getattr(request, "shared_prefix_boundary", 0)
        if isinstance(junction, int) and junction > 0:
            boundaries.append(junction)
            if self.use_eagle and junction >= self.block_size:
                boundaries.append(junction - self.block_size)
        return tuple(boundaries)


class SparseRetention(Feature):
    """Installs :class:`RetainingSlidingWindowManager` (H2)."""

    def configure(self, coordinator: KVCacheCoordinator) -> None:
        for index, manager in enumerate(coordinator.managers):
            if type(manager) is SlidingWindowManager:
                assert not manager.req_to_blocks
                coordinator.managers[index] = RetainingSlidingWindowManager(
                    manager.kv_cache_spec, block_pool=manager.block_pool, group_id=manager.group_id,
                    block_size=manager.block_size, enable_caching=manager.enable_caching,
                    alignment=manager.alignment, use_eagle=manager.replay_eagle,
                    retention_interval=manager.retention_interval, admission_cap=manager.admission_cap)
