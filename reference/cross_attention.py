"""Cross-attention (spec/managers.md §7, XATTN-1): blocks hold one request's
encoder output, sized by the encoder tokens, never cached, never hit."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

__all__ = ["CrossAttentionManager"]


class CrossAttentionManager(SingleTypeManager):
    """Sized by ``num_encoder_tokens``; only the empty hit qualifies (D-XATTN-1)."""

    uses_eagle_rule = False

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        return length == 0

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """A new request holds no encoder blocks until they are allocated."""
        self.req_to_blocks[request_id], self.num_cached_blocks[request_id] = [], 0

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        """External tokens are decoder tokens: no encoder blocks for them."""

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        """Never cached: encoder output is specific to one request."""

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        if any(block.block_hash is not None for block in blocks):  # XATTN-1: never cached
            return f"XATTN-1: request {request_id!r} holds a hashed cross-attention block"
        return None
