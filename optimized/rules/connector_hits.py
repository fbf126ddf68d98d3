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

The optimized implementation's copy: step 1f calls this once per Mamba group;
the reference states them again in ``pagedkv.reference.features``, so the
lockstep machines compare two versions.
"""

from __future__ import annotations

from pagedkv.optimized.rules.mamba_partial_rules import hit_fits

__all__ = ["connector_completes_state"]


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
