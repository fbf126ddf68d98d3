"""Sub-block (partial) hits for Mamba ``align`` groups: which configurations
support them and which key names a state (spec/mamba.md, "Sub-block hits").

The optimized implementation's copy (D-MAMBA-11, D-MAMBA-15); the reference
states them again in ``pagedkv.reference.features``, and the
lockstep machines compare the keys both publish and look up.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.rules.mamba_checkpoint_rules import checkpoint_position
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import BlockHash

__all__ = ["partial_hits_supported", "check_supported", "state_key", "state_keys_in_block", "hit_fits",
           "resume_position", "shared_prefix_checkpoint_supported"]


def partial_hits_supported(kinds: Sequence[str], specs: Sequence[object], block_sizes: Sequence[int],
                           hash_block_size: int, *, enable_caching: bool, use_eagle: bool,
                           configured: bool) -> str | None:
    """Why sub-block hits cannot be turned on for this configuration, or
    ``None`` when they can (D-MAMBA-15): vLLM would enable them
    (``configured``, MCKPT-4), caching is on, every Mamba group with a
    larger block is in mode ``align``, and every other group is full
    attention (sink included) whose block is the hash block -- or plain
    full attention with a larger block, which then hits inside its own
    blocks with copy-on-write too (FPART-1..4, D-MAMBA-21), EAGLE included:
    it gives back one hash block inside such a block (FPART-5, D-MAMBA-38)."""
    if not enable_caching:
        return "prefix caching is off"
    if not configured:
        return "vLLM would not enable partial hash hits for these groups (MCKPT-4)"
    # EAGLE is allowed (D-MAMBA-36, D-MAMBA-38): full attention gives back
    # one hash block (inside its own block when larger, FPART-5), and a
    # Mamba checkpoint already sits one hash block lower under EAGLE.
    for index, (kind, spec, block_size) in enumerate(zip(kinds, specs, block_sizes)):
        if isinstance(spec, KVCacheSpec) and not prefix_cacheable(spec):
            continue  # a ring or bounded-replay group never looks up (PFX-1)
        if isinstance(spec, MambaSpec):
            if block_size != hash_block_size and spec.mamba_cache_mode != "align":
                return f"kv_cache_groups[{index}]: Mamba mode {spec.mamba_cache_mode!r} is not 'align'"
        elif kind not in ("full_attention", "sink_full_attention", "rswa"):
            return f"kv_cache_groups[{index}]: kind {kind!r} is not supported with sub-block hits yet"
        elif block_size != hash_block_size and kind != "full_attention":
            return (f"kv_cache_groups[{index}]: block size {block_size} is not the hash block size "
                    f"{hash_block_size}")
    return None


def check_supported(reason: str | None) -> None:
    """Raise the typed error for :func:`partial_hits_supported`'s answer."""
    if reason is not None:
        raise InvalidConfigError(f"enable_partial_hash_hits: {reason}")


def state_key(fine_hashes: Sequence[BlockHash], num_tokens: int, hash_block_size: int,
              block_size: int) -> BlockHash | None:
    """The key of the state after ``num_tokens`` tokens: the group's full-block
    key at a block end (the concatenation of its hash blocks, D-HASH-5), else
    the hash of the hash block ending there (a partial key); ``None`` when
    the request has no hash that far or ``num_tokens`` is not on a hash
    boundary."""
    num_hash_blocks = num_tokens // hash_block_size
    if num_tokens <= 0 or num_tokens % hash_block_size or num_hash_blocks > len(fine_hashes):
        return None
    if num_tokens % block_size == 0:
        scale = block_size // hash_block_size
        return BlockHash(b"".join(fine_hashes[num_hash_blocks - scale:num_hash_blocks]))
    return fine_hashes[num_hash_blocks - 1]


def state_keys_in_block(fine_hashes: Sequence[BlockHash], index: int, hash_block_size: int,
                        block_size: int) -> set[BlockHash]:
    """Every key a state held by block ``index`` may carry: one per hash
    boundary inside the block or at its end (a hit's state block)."""
    keys = (state_key(fine_hashes, index * block_size + offset, hash_block_size, block_size)
            for offset in range(hash_block_size, block_size + 1, hash_block_size))
    return {key for key in keys if key is not None}


def hit_fits(num_tokens: int, num_blocks: int, block_size: int, hash_block_size: int,
             sub_block: bool) -> bool:
    """Whether a hit of ``num_tokens`` tokens handed as ``num_blocks`` blocks
    has the right shape for a group: whole blocks, or with sub-block hits
    (MPART-1) whole hash blocks and the block holding the last of them."""
    if sub_block:
        return num_tokens % hash_block_size == 0 and num_blocks == -(-num_tokens // block_size)
    return num_tokens % block_size == 0 and num_blocks == num_tokens // block_size


def resume_position(num_tokens: int, *, num_prompt_tokens: int, hash_block_size: int, drop_eagle_block: bool,
                    num_hash_lookahead_tokens: int, shared_prefix_checkpoint: bool, shared_prefix_boundary: int,
                    num_computed_tokens: int) -> bool:
    """Whether a Mamba ``align`` caching call ending at ``num_tokens`` ends
    where a sibling resumes, so the state there is published (MPART-4..6):
    the prompt's last reusable hash boundary (``checkpoint_position`` at the
    hash block), or, with the shared-prefix checkpoint on (D-MAMBA-40), the
    request's observed junction -- only while it lies inside the prompt and
    inside the chunk being computed (past the prompt the block is the
    running state, overwritten before a sibling could read it).

    pre: hash_block_size > 0
    post: not __return__ or (num_tokens > 0 and num_tokens % hash_block_size == 0)
    """
    if num_tokens <= 0 or num_tokens % hash_block_size:
        return False
    if num_tokens == checkpoint_position(num_prompt_tokens, hash_block_size, drop_eagle_block,
                                         num_hash_lookahead_tokens):
        return True
    return (shared_prefix_checkpoint and num_tokens == shared_prefix_boundary
            and num_computed_tokens < num_tokens <= num_prompt_tokens)


def shared_prefix_checkpoint_supported(*, partial_hits_on: bool, eagle_groups: bool,
                                       num_reprefillable_tokens: int) -> str | None:
    """Why the shared-prefix (EAGLE resume) checkpoint cannot be switched on,
    or ``None`` (D-MAMBA-40): sub-block hits must be on, the model must draft
    (``use_eagle``), and no token may be re-prefilled by a multi-module
    drafter (its caching calls then end short of the chunk, so the junction
    stop would never be cached)."""
    if not partial_hits_on:
        return "sub-block hits are off (enable_partial_hash_hits first)"
    if not eagle_groups:
        return "the model does not draft (use_eagle is off)"
    if num_reprefillable_tokens:
        return f"{num_reprefillable_tokens} re-prefilled token(s) per step (multi-module MTP)"
    return None
