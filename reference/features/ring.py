"""Ring groups (``CircularBufferSpec``, spec/managers.md §7a, RING-1).

A ring holds the rows a compressor has not folded into its compressed cache
yet. Its size does not grow with the request: one block per request, taken
at the request's first allocation and kept until it is released. A ring
takes no part in prefix caching (PFX-1), so it never hits, never caches and
never releases a block early.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.hooks import Feature
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

__all__ = ["Ring", "RingManager"]


class RingManager(SingleTypeManager):
    """One block per request, whatever its length (RING-1)."""

    uses_eagle_rule = False

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        return True  # never asked: the coordinator leaves the group out of hits (PFX-1)

    def hit_blocks(self, block_hashes: Sequence[BlockHash], length: int,
                   max_length: int | None = None) -> list[KVCacheBlock]:
        return []

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int,
                                   num_main_tokens: int, num_external_computed_tokens: int = 0) -> int:
        # The ring block, unless the request holds it already.
        return 0 if self.req_to_blocks.get(request_id) else 1

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        # A ring is never part of a hit: the request starts with no block.
        self.req_to_blocks[request_id] = []
        self.num_cached_blocks[request_id] = 0

    def _claim(self, request_id: str) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        if blocks:
            return []
        blocks.extend(self.block_pool.get_new_blocks(1))
        return list(blocks)

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        # With external tokens the ring is claimed here, in group order with
        # the other groups' external blocks (as vLLM 0.33 orders them).
        if num_external_computed_tokens > 0:
            self._claim(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_main_tokens: int) -> list[KVCacheBlock]:
        return self._claim(request_id)

    def remove_skipped_blocks(self, request_id: str, num_total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return  # the compressor reads its ring until the request ends

    def admission_blocks(self, num_tokens: int) -> int:
        return 1

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        return  # never cached (PFX-1)

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        # RING-1: a ring group holds at most one block, real and never cached.
        if len(blocks) > 1 or any(block.is_null or block.block_hash is not None for block in blocks):
            ids = [block.block_id for block in blocks]
            return f"RING-1: request {request_id!r} ring group {self.group_id} holds {ids}"
        return None


class Ring(Feature):
    """The ring feature: the ``circular_buffer`` manager kind (H1)."""

    def attention_types(self) -> Mapping[str, type[SingleTypeManager]]:
        return {"circular_buffer": RingManager}
