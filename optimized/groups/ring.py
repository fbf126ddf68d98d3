"""Ring groups (``CircularBufferSpec``, spec/managers.md §7a, RING-1): one
block per request, taken at its first allocation and kept until release.

A compressor keeps the rows it has not folded yet in a fixed ring, so the
group's demand does not grow with the request. The group takes no part in
prefix caching (PFX-1): the coordinator leaves it out of hit searches and
caching, and it never releases a block early. The decode probe
(``decode.py``) treats a held ring as a group that never needs a slot.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

__all__ = ["RingManager"]


class RingManager(SingleTypeManager):
    """One block per request, whatever its length (RING-1)."""

    __slots__ = ()

    uses_eagle_rule = False
    holds_null_blocks = False

    def longest_hit(self, view: Sequence[BlockHash], bound: int, max_length: int) -> int:
        """Never asked (PFX-1); every length would do. Cost: O(1)."""
        return bound

    def hit_blocks(self, view: Sequence[BlockHash], length: int, max_length: int | None = None) -> list[int]:
        """Always empty. Cost: O(1)."""
        return []

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int],
                                   num_total_computed_tokens: int, num_main_tokens: int,
                                   num_external_computed_tokens: int = 0) -> int:
        """The ring block unless the request holds it. Cost: O(1)."""
        return 0 if self.req_to_blocks.get(request_id) else 1

    def admit(self, request_id: str, new_computed_blocks: Sequence[int],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """The request starts with no block (a ring is never hit). Cost: O(1)."""
        self.req_to_blocks[request_id] = []
        self.num_cached_blocks[request_id] = 0

    def _claim(self, request_id: str) -> list[int]:
        blocks = self.req_to_blocks[request_id]
        if blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        blocks.extend(new_blocks)
        return new_blocks

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        """Claimed with the other groups' external blocks, in group order. Cost: O(1)."""
        if num_external_computed_tokens > 0:
            self._claim(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[int]:
        """The ring block at the first allocation, then nothing. Cost: O(1)."""
        return self._claim(request_id)

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int) -> None:
        """Nothing: the compressor reads its ring until the end. Cost: O(1)."""

    def cache_blocks(self, request: HashedRequest, view: Sequence[BlockHash] | None,
                     request_id: str, num_tokens: int) -> None:
        """Nothing is cached (PFX-1). Cost: O(1)."""
