"""A KV connector completing a Mamba group's shorter hit (D-API-46,
spec/operations.md step 1f).

A hybrid model's groups can hit to different depths when blocks are
evicted: full attention may still hold four blocks of a prefix while the
Mamba group kept only the state after the first. With a connector that can
restore the Mamba state, vLLM 0.33's scheduler adopts the full-attention
hit (``get_computed_blocks_for_connector``) and lets the connector load the
tokens after it, Mamba state included. The Mamba group then hands fewer hit
blocks than the hit's length covers.

That is safe only because of how external tokens place a Mamba state: with
``num_external_computed_tokens > 0`` every Mamba hit block lies below the
state the request resumes from (the state after all computed tokens, which
the connector writes into a fresh block), so step 6 drops them all as
skipped and no hit block is read. Without external tokens the shorter hit
would resume from a state nobody wrote, so it stays refused.

The reference's statement: step 1f calls this once per Mamba group;
``pagedkv.optimized`` states them again in its own module, so the
lockstep machines compare two versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.reference.features.mamba_partial_rules import hit_fits
from pagedkv.reference.hooks import Feature

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator
    from pagedkv.reference.single_type import SingleTypeManager

__all__ = ["ConnectorHits", "connector_completes_state"]


def connector_completes_state(num_tokens: int, num_blocks: int, block_size: int, hash_block_size: int,
                              sub_block: bool, num_external_computed_tokens: int) -> bool:
    """Whether a Mamba group's hit of ``num_blocks`` blocks, fewer than a hit
    of ``num_tokens`` tokens holds, is accepted because external tokens
    follow it: the tokens still have the shape :func:`hit_fits` asks for,
    and the connector supplies the state after them."""
    if num_external_computed_tokens <= 0:
        return False
    expected = -(-num_tokens // block_size) if sub_block else num_tokens // block_size
    return num_blocks < expected and hit_fits(num_tokens, expected, block_size, hash_block_size, sub_block)


class ConnectorHits(Feature):
    """A Mamba group may hit shallower when a connector loads the state (H4, D-API-46)."""

    def accepts_hit(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager, num_tokens: int,
                    num_blocks: int, num_external_computed_tokens: int) -> bool:
        from pagedkv.reference.mamba import MambaManager  # the kernel module; loaded before any call

        return isinstance(manager, MambaManager) and connector_completes_state(
            num_tokens, num_blocks, manager.block_size, coordinator.hash_block_size,
            getattr(manager, "partial_hits", False), num_external_computed_tokens)
