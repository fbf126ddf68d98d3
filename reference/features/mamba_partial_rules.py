"""Sub-block (partial) hits for Mamba ``align`` groups: which configurations
support them and which key names a state (spec/mamba.md, "Sub-block hits").

The reference's statement, written apart from ``pagedkv.optimized``'s: each
refusal is read group by group, the state keys and hit shapes by listing the
hash blocks and blocks they cover (D-MAMBA-11, D-MAMBA-15). The lockstep
machines compare the keys both publish and look up.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference.features.mamba_checkpoint_rules import checkpoint_position
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import BlockHash

__all__ = ["partial_hits_supported", "check_supported", "state_key", "state_keys_in_block", "hit_fits",
           "resume_position", "shared_prefix_checkpoint_supported"]

_HASH_BLOCK_KINDS = ("full_attention", "sink_full_attention", "rswa")
"""The non-Mamba kinds that may join sub-block hits (with a block of one hash block)."""


def _group_refusal(index: int, kind: str, spec: object, block_size: int, hash_block_size: int) -> str | None:
    """Why group ``index`` keeps sub-block hits off, or ``None`` (D-MAMBA-15)."""
    if isinstance(spec, KVCacheSpec) and not prefix_cacheable(spec):
        return None  # a ring or bounded-replay group never looks up (PFX-1)
    one_hash_block = block_size == hash_block_size
    if isinstance(spec, MambaSpec):
        if one_hash_block or spec.mamba_cache_mode == "align":
            return None
        return f"kv_cache_groups[{index}]: Mamba mode {spec.mamba_cache_mode!r} is not 'align'"
    if kind not in _HASH_BLOCK_KINDS:
        return f"kv_cache_groups[{index}]: kind {kind!r} is not supported with sub-block hits yet"
    # Plain full attention may have a larger block: it hits inside its own
    # blocks with copy-on-write (FPART-1..4, D-MAMBA-21; EAGLE: FPART-5).
    if one_hash_block or kind == "full_attention":
        return None
    return f"kv_cache_groups[{index}]: block size {block_size} is not the hash block size {hash_block_size}"


def partial_hits_supported(kinds: Sequence[str], specs: Sequence[object], block_sizes: Sequence[int],
                           hash_block_size: int, *, enable_caching: bool, use_eagle: bool,
                           configured: bool) -> str | None:
    """The first reason sub-block hits cannot be on here, or ``None`` when
    they can (D-MAMBA-15): caching on, vLLM would enable them (MCKPT-4), and
    no group refuses (:func:`_group_refusal`). EAGLE does not refuse
    (D-MAMBA-36, D-MAMBA-38): full attention gives back one hash block, and
    a Mamba checkpoint already sits one hash block lower under EAGLE."""
    if not enable_caching:
        return "prefix caching is off"
    if not configured:
        return "vLLM would not enable partial hash hits for these groups (MCKPT-4)"
    refusals = (_group_refusal(index, kind, spec, block_size, hash_block_size)
                for index, (kind, spec, block_size) in enumerate(zip(kinds, specs, block_sizes)))
    return next((reason for reason in refusals if reason is not None), None)


def check_supported(reason: str | None) -> None:
    """Refuse with :class:`InvalidConfigError` when :func:`partial_hits_supported` gave a reason."""
    if reason is None:
        return
    raise InvalidConfigError(f"enable_partial_hash_hits: {reason}")


def state_key(fine_hashes: Sequence[BlockHash], num_tokens: int, hash_block_size: int,
              block_size: int) -> BlockHash | None:
    """The key of the state after ``num_tokens`` tokens (D-HASH-5): at a
    block end, the hash blocks of that block joined in order; inside a
    block, the hash of the hash block ending there (a partial key).
    ``None`` off a positive hash boundary or past the request's hashes."""
    on_boundary = num_tokens > 0 and num_tokens % hash_block_size == 0
    if not on_boundary or num_tokens > len(fine_hashes) * hash_block_size:
        return None
    # Hash block i holds tokens [i * h, (i + 1) * h).
    if num_tokens % block_size == 0:
        block_start = num_tokens - block_size
        inside = [fine_hashes[i] for i in range(len(fine_hashes))
                  if block_start <= i * hash_block_size < num_tokens]
        return BlockHash(b"".join(inside))
    ending_here = [fine_hashes[i] for i in range(len(fine_hashes)) if (i + 1) * hash_block_size == num_tokens]
    return ending_here[0]


def state_keys_in_block(fine_hashes: Sequence[BlockHash], index: int, hash_block_size: int,
                        block_size: int) -> set[BlockHash]:
    """Every key a state held by block ``index`` may carry: the key of each
    token count that ends inside the block or at its end (a hit's state block)."""
    first, last = index * block_size + 1, (index + 1) * block_size
    keys = {state_key(fine_hashes, end, hash_block_size, block_size) for end in range(first, last + 1)}
    return {key for key in keys if key is not None}


def hit_fits(num_tokens: int, num_blocks: int, block_size: int, hash_block_size: int,
             sub_block: bool) -> bool:
    """Whether a hit of ``num_tokens`` tokens handed as ``num_blocks`` blocks
    has a group's shape: it ends on a block end (on a hash boundary with
    sub-block hits, MPART-1) and hands one block per block its tokens touch."""
    unit = hash_block_size if sub_block else block_size
    if num_tokens < 0 or num_tokens % unit:
        return False
    blocks_touched = len(range(0, num_tokens, block_size))
    return num_blocks == blocks_touched


def resume_position(num_tokens: int, *, num_prompt_tokens: int, hash_block_size: int, drop_eagle_block: bool,
                    num_hash_lookahead_tokens: int, shared_prefix_checkpoint: bool, shared_prefix_boundary: int,
                    num_computed_tokens: int) -> bool:
    """Whether a Mamba ``align`` caching call ending at ``num_tokens`` (a
    positive hash boundary) ends where a sibling resumes, so the state there
    is published (MPART-4..6). The positions a sibling resumes from: the
    prompt's last reusable hash boundary (``checkpoint_position`` at the
    hash block) and, with the shared-prefix checkpoint on (D-MAMBA-40,
    MPART-6), the observed junction while it lies inside the prompt and in
    the chunk being computed (past the prompt the block is the running
    state, overwritten before a sibling could read it).

    pre: hash_block_size > 0
    post: not __return__ or (num_tokens > 0 and num_tokens % hash_block_size == 0)
    """
    if num_tokens <= 0 or num_tokens % hash_block_size != 0:
        return False
    resumes = {checkpoint_position(num_prompt_tokens, hash_block_size, drop_eagle_block, num_hash_lookahead_tokens)}
    junction_in_chunk = num_computed_tokens < shared_prefix_boundary <= num_prompt_tokens
    if shared_prefix_checkpoint and junction_in_chunk:
        resumes.add(shared_prefix_boundary)
    return num_tokens in resumes


def shared_prefix_checkpoint_supported(*, partial_hits_on: bool, eagle_groups: bool,
                                       num_reprefillable_tokens: int) -> str | None:
    """The first reason the shared-prefix (EAGLE resume) checkpoint cannot be
    on, or ``None`` (D-MAMBA-40). A multi-module drafter re-prefills tokens,
    so its caching calls end short of the chunk and never cache the junction."""
    requirements = (
        (partial_hits_on, "sub-block hits are off (enable_partial_hash_hits first)"),
        (eagle_groups, "the model does not draft (use_eagle is off)"),
        (num_reprefillable_tokens == 0,
         f"{num_reprefillable_tokens} re-prefilled token(s) per step (multi-module MTP)"),
    )
    return next((reason for met, reason in requirements if not met), None)
