"""Cross-attention (encoder-decoder models): blocks hold the encoder's
output for one request, sized by the encoder tokens, never cached and never
hit (spec/managers.md, XATTN-1)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

__all__ = ["CrossAttentionManager"]


class CrossAttentionManager(SingleTypeManager):
    """Sized by ``num_encoder_tokens`` (the coordinator passes those in place
    of decoder tokens). Its state is per request, so a prefix hit of the
    decoder cannot serve it: only the empty hit qualifies (D-XATTN-1)."""

    uses_eagle_rule = False

    def can_hit(self, block_hashes: Sequence[BlockHash], length: int, max_length: int) -> bool:
        return length == 0

    def hit_blocks(self, block_hashes: Sequence[BlockHash], length: int,
                   max_length: int | None = None) -> list[KVCacheBlock]:
        return []

    def admit(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """A new request holds no encoder blocks until they are allocated."""
        self.req_to_blocks[request_id] = []
        self.num_cached_blocks[request_id] = 0

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        """External tokens are decoder tokens: no encoder blocks for them."""

    def cache_blocks(self, request: HashedRequest, block_hashes: Sequence[BlockHash],
                     request_id: str, num_tokens: int) -> None:
        """Never cached: encoder output is specific to one request."""

    def check_request_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> str | None:
        # XATTN-1: cross-attention blocks are never cached.
        if any(block.block_hash is not None for block in blocks):
            return f"XATTN-1: request {request_id!r} holds a hashed cross-attention block"
        return None
