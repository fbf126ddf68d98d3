"""A KV connector completing a Mamba group's shorter hit (D-API-46,
spec/operations.md step 1f).

When blocks are evicted, a hybrid model's groups can hit to different
depths: full attention may still hold four blocks of a prefix while the
Mamba group kept only the state after the first. vLLM 0.33's scheduler then
takes the full-attention hit (``get_computed_blocks_for_connector``) if a
connector can restore the Mamba state, and the connector loads the tokens
after it, state included. The Mamba group hands fewer hit blocks than the
hit's length covers.

Why that is safe: with ``num_external_computed_tokens > 0`` the request
resumes from the state after all computed tokens, which the connector
writes into a fresh block, so every Mamba hit block lies below it and step
6 drops them all as skipped; none is read. With no external tokens the
shorter hit would resume from a state nobody wrote: it stays refused.

The reference states the rule by counting the blocks the hit's tokens
touch; ``pagedkv.optimized`` has its own version, and the lockstep machines
compare the two. Step 1f asks it once per Mamba group.
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
    """Whether a Mamba group's hit of ``num_blocks`` blocks is accepted though
    a hit of ``num_tokens`` tokens holds more: external tokens follow it (the
    connector supplies the state after them), and the tokens have a hit's
    shape (:func:`hit_fits`) for the blocks they would need."""
    if num_external_computed_tokens < 1:
        return False  # no connector tokens follow the hit: nobody writes the state it resumes from
    if sub_block:
        needed = len(range(0, num_tokens, block_size))  # every block the tokens touch
    else:
        needed = len([end for end in range(block_size, num_tokens + 1, block_size)])  # whole blocks only
    shorter = num_blocks < needed
    return shorter and hit_fits(num_tokens, needed, block_size, hash_block_size, sub_block)


class ConnectorHits(Feature):
    """A Mamba group may hit shallower when a connector loads the state (H4, D-API-46)."""

    def accepts_hit(self, coordinator: KVCacheCoordinator, manager: SingleTypeManager, num_tokens: int,
                    num_blocks: int, num_external_computed_tokens: int) -> bool:
        from pagedkv.reference.mamba import MambaManager  # the kernel module; loaded before any call

        return isinstance(manager, MambaManager) and connector_completes_state(
            num_tokens, num_blocks, manager.block_size, coordinator.hash_block_size,
            getattr(manager, "partial_hits", False), num_external_computed_tokens)
