"""Cross-attention (encoder-decoder models): blocks hold the encoder's
output for one request, sized by the encoder tokens, never cached and never
hit (spec/managers.md, XATTN-1, D-XATTN-1)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.single_type import SingleTypeManager
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

__all__ = ["CrossAttentionManager"]


class CrossAttentionManager(SingleTypeManager):
    """Sized by ``num_encoder_tokens`` (the coordinator passes those in place
    of decoder tokens). Its state is per request, so a prefix hit of the
    decoder cannot serve it: only the empty hit qualifies."""

    __slots__ = ()

    uses_eagle_rule = False
    always_empty_hit = True

    def longest_hit(self, view: Sequence[BlockHash], bound: int, max_length: int) -> int:
        """Always 0. Cost: O(1)."""
        return 0

    def hit_blocks(self, view: Sequence[BlockHash], length: int, max_length: int | None = None) -> list[int]:
        """Always empty. Cost: O(1)."""
        return []

    def admit(self, request_id: str, new_computed_blocks: Sequence[int],
              num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """A new request holds no encoder blocks until they are allocated. Cost: O(1)."""
        self.req_to_blocks[request_id] = []
        self.num_cached_blocks[request_id] = 0

    def allocate_external(self, request_id: str, num_total_computed_tokens: int,
                          num_external_computed_tokens: int) -> None:
        """External tokens are decoder tokens: no encoder blocks for them. Cost: O(1)."""

    def cache_blocks(self, request: HashedRequest, view: Sequence[BlockHash] | None,
                     request_id: str, num_tokens: int) -> None:
        """Never cached: encoder output is specific to one request. Cost: O(1)."""
