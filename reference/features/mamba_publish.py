"""Which Mamba states enter the prefix cache, and which are handed to a KV
connector (spec/mamba.md, "Publication": MRET-1, MCKPT-5, MOFF-2, MTAIL-1).

Kept apart from :mod:`.mamba_states` so each rule reads on its own:

- sparse retention thins the full-block states a Mamba group caches
  (:func:`retention_mask`);
- a prefill checkpoint block is keyed at its exported position when that
  state is worth keeping, else it stays unkeyed (:func:`publish_checkpoint`);
- with sub-block hits, the state where a sibling resumes -- the prompt's
  last reusable boundary or an observed shared-prefix junction -- is keyed
  when a caching call ends there (:func:`publish_resume_state`, MPART-4..6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.reference import rules
from pagedkv.reference.features.mamba_checkpoint_rules import (
    checkpoint_published,
    mamba_kept_boundaries,
    mamba_retention_mask,
)
from pagedkv.reference.features.mamba_partial import key_block
from pagedkv.reference.features.mamba_partial_rules import resume_position, state_key
from pagedkv.spec.hashing import HashedRequest

if TYPE_CHECKING:
    from pagedkv.reference.features.mamba_states import MambaStateManager as MambaManager

__all__ = ["retention_mask", "publish_checkpoint", "publish_resume_state"]


def retention_mask(manager: MambaManager, request: HashedRequest, num_cached: int,
                   num_full: int) -> list[bool] | None:
    """The full-block states of ``[num_cached, num_full)`` retention keeps (MRET-1)."""
    boundaries = mamba_kept_boundaries(getattr(request, "num_prompt_tokens", None),
                                       getattr(request, "shared_prefix_boundary", 0),
                                       manager.alignment, manager.replay_eagle)
    return mamba_retention_mask(num_cached, num_full, manager.block_size,
                                manager.cache_hit_alignment_tokens, manager.retention_interval, boundaries)


def publish_checkpoint(manager: MambaManager, request: HashedRequest, request_id: str) -> None:
    """Key the request's checkpoint block at its position when the state is
    published (MCKPT-5), replacing any other key it carries; else make sure
    it carries none (the next step overwrites it)."""
    found = manager.checkpoints.get(request_id)
    if found is None:
        return
    position, column = found
    blocks = manager.req_to_blocks[request_id]
    if column >= len(blocks) or blocks[column].is_null:
        return
    block = blocks[column]
    pool = manager.block_pool
    published = checkpoint_published(
        position=position, num_prompt_tokens=getattr(request, "num_prompt_tokens", None),
        alignment=manager.cache_hit_alignment_tokens, drop_eagle_block=manager.drop_eagle_checkpoint,
        num_hash_lookahead_tokens=manager.hash_lookahead_tokens(), block_size=manager.block_size,
        retention_interval=manager.retention_interval,
        shared_prefix_boundary=getattr(request, "shared_prefix_boundary", 0),
        partial_keys=manager.partial_hits)
    if not published:
        pool.evict_blocks([block.block_id])
        return
    if pool.key_tokens(block.block_id) == position:
        return  # keyed there already (an earlier call this step)
    key = state_key(request.block_hashes, position, manager.hash_block_size, manager.block_size)
    if key is None:
        return  # the hashes do not reach the position yet
    pool.evict_blocks([block.block_id])
    manager.cached_this_step.add(key_block(pool, block, key, manager.group_id, position))


def publish_resume_state(manager: MambaManager, request: HashedRequest, request_id: str, num_tokens: int) -> None:
    """Key the state a caching call ending at ``num_tokens`` leaves, when a
    sibling resumes there (``resume_position``) and the request has no
    prefill checkpoint (D-MAMBA-16).

    Inside a block (MPART-4, MPART-6): an unkeyed block takes the partial
    key, once per request and boundary; the request must copy it before
    writing on. At a block end (MPART-5): the block takes the state's key
    unless it carries it already (a shorter key gives way, with its event);
    the running state moves to a new block next step, so no copy.
    """
    prompt = getattr(request, "num_prompt_tokens", None)
    if (type(prompt) is not int or request_id in manager.checkpoints or num_tokens != manager.caching_end
            or not resume_position(num_tokens, num_prompt_tokens=prompt, hash_block_size=manager.hash_block_size,
                                   drop_eagle_block=manager.drop_eagle_checkpoint,
                                   num_hash_lookahead_tokens=manager.hash_lookahead_tokens(),
                                   shared_prefix_checkpoint=manager.shared_prefix_checkpoint,
                                   shared_prefix_boundary=getattr(request, "shared_prefix_boundary", 0),
                                   num_computed_tokens=getattr(request, "num_computed_tokens", 0))):
        return
    size = manager.block_size
    column = rules.cdiv(num_tokens, size) - 1
    blocks = manager.req_to_blocks[request_id]
    key = state_key(request.block_hashes, num_tokens, manager.hash_block_size, size)
    if column >= len(blocks) or blocks[column].is_null or key is None:
        return
    block, pool = blocks[column], manager.block_pool
    if num_tokens % size == 0:
        if pool.key_tokens(block.block_id) == num_tokens:
            return
        pool.evict_blocks([block.block_id])
        manager.cached_this_step.add(key_block(pool, block, key, manager.group_id, num_tokens))
        return
    if (request_id, num_tokens) in manager.published_tail or block.block_hash is not None:
        return
    manager.cached_this_step.add(key_block(pool, block, key, manager.group_id, num_tokens))
    manager.published_tail.add((request_id, num_tokens))
    manager.producer_tail[request_id] = (block, num_tokens)
    manager.partial_hit[request_id] = (column, block)
    manager.num_cached_blocks[request_id] = min(manager.num_cached_blocks[request_id], column)
