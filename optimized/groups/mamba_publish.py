"""Which Mamba states enter the prefix cache, and which are handed to a KV
connector (spec/mamba.md, "Publication": MRET-1, MCKPT-5, MOFF-2, MTAIL-1),
on the optimized pool's block ids. Same rules as the reference's module of
this name; the shared formulas live in :mod:`pagedkv.optimized.rules.mamba_checkpoint_rules`.
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.optimized.groups.mamba_partial import key_block
from pagedkv.optimized.pool.block_pool import BlockPool
from pagedkv.optimized.rules.mamba_checkpoint_rules import (
    checkpoint_published,
    mamba_kept_boundaries,
    mamba_retention_mask,
)
from pagedkv.optimized.rules.mamba_partial_rules import resume_position, state_key
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHash

__all__ = ["MambaState", "retention_mask", "publish_checkpoint", "finalize_partial_tail", "publish_resume_state"]


class MambaState(Protocol):
    """The tables of a :class:`~pagedkv.optimized.groups.mamba.MambaManager` these
    functions read and write (each the attribute of that name there). A protocol, not
    the class: ``mamba.py`` imports this module, so naming the class here would close
    an import circle."""

    block_pool: BlockPool
    block_size: int
    group_id: int
    hash_block_size: int
    cache_hit_alignment_tokens: int
    replay_alignment: int
    retention_interval: int | None
    caching_end: int
    drop_eagle_checkpoint: bool
    replay_eagle: bool
    partial_hits: bool
    shared_prefix_checkpoint: bool
    cached_this_step: set[BlockHash]
    checkpoints: dict[str, tuple[int, int]]
    num_cached_blocks: dict[str, int]
    req_to_blocks: dict[str, list[int]]
    partial_hit: dict[str, tuple[int, int]]
    producer_tail: dict[str, tuple[int, int]]
    published_tail: set[tuple[str, int]]

    def hash_lookahead_tokens(self) -> int:
        """Tokens past the computed ones whose hashes a lookup may read."""


def retention_mask(manager: MambaState, request: HashedRequest, num_cached: int,
                   num_full: int) -> list[bool] | None:
    """The full-block states of ``[num_cached, num_full)`` retention keeps
    (MRET-1). Cost: O(1) when dense, else O(num_full - num_cached)."""
    interval = manager.retention_interval
    if interval is None:
        return None
    boundaries = mamba_kept_boundaries(getattr(request, "num_prompt_tokens", None),
                                       getattr(request, "shared_prefix_boundary", 0),
                                       manager.replay_alignment, manager.replay_eagle)
    return mamba_retention_mask(num_cached, num_full, manager.block_size,
                                manager.cache_hit_alignment_tokens, interval, boundaries)


def publish_checkpoint(manager: MambaState, request: HashedRequest, request_id: str) -> None:
    """Key the request's checkpoint block at its position when published
    (MCKPT-5), replacing another key; else leave it unkeyed. Cost: O(1)
    plus the key's bytes."""
    found = manager.checkpoints.get(request_id)
    if found is None:
        return
    position, column = found
    blocks = manager.req_to_blocks[request_id]
    if column >= len(blocks) or not blocks[column]:
        return
    block = blocks[column]
    pool = manager.block_pool
    if not checkpoint_published(
            position=position, num_prompt_tokens=getattr(request, "num_prompt_tokens", None),
            alignment=manager.cache_hit_alignment_tokens, drop_eagle_block=manager.drop_eagle_checkpoint,
            num_hash_lookahead_tokens=manager.hash_lookahead_tokens(), block_size=manager.block_size,
            retention_interval=manager.retention_interval,
            shared_prefix_boundary=getattr(request, "shared_prefix_boundary", 0),
            partial_keys=manager.partial_hits):
        pool.evict_blocks((block,))  # transient: the next step overwrites it
        return
    if pool.key_tokens(block) == position:
        return
    key = state_key(request.block_hashes, position, manager.hash_block_size, manager.block_size)
    if key is None:
        return
    pool.evict_blocks((block,))
    key_block(pool, block, key, manager.group_id, position)
    manager.cached_this_step.add(key)


def finalize_partial_tail(manager: MambaState, request_id: str, num_computed_tokens: int,
                          num_in_flight_tokens: int) -> tuple[int, int] | None:
    """A finishing producer's uncopied tail (block, boundary), when no later
    token ran (MTAIL-1); consumed either way. Cost: O(1)."""
    tail = manager.producer_tail.pop(request_id, None)
    if tail is None or num_in_flight_tokens != 0 or num_computed_tokens != tail[1]:
        return None
    return tail


def publish_resume_state(manager: MambaState, request: HashedRequest, request_id: str, num_tokens: int) -> None:
    """Key the state where a sibling resumes when a caching call ends there
    (MPART-4..6; the reference's rule of this name). Cost: O(1) plus the key's bytes."""
    prompt = getattr(request, "num_prompt_tokens", None)
    if (type(prompt) is not int or num_tokens != manager.caching_end or request_id in manager.checkpoints
            or not resume_position(num_tokens, num_prompt_tokens=prompt, hash_block_size=manager.hash_block_size,
                                   drop_eagle_block=manager.drop_eagle_checkpoint,
                                   num_hash_lookahead_tokens=manager.hash_lookahead_tokens(),
                                   shared_prefix_checkpoint=manager.shared_prefix_checkpoint,
                                   shared_prefix_boundary=getattr(request, "shared_prefix_boundary", 0),
                                   num_computed_tokens=getattr(request, "num_computed_tokens", 0))):
        return
    size = manager.block_size
    column = -(-num_tokens // size) - 1
    blocks = manager.req_to_blocks[request_id]
    if column >= len(blocks) or not blocks[column]:
        return
    key = state_key(request.block_hashes, num_tokens, manager.hash_block_size, size)
    if key is None:
        return
    block, pool = blocks[column], manager.block_pool
    if num_tokens % size == 0:
        # A block end (MPART-5): the running state moves on next step, no copy.
        if pool.key_tokens(block) == num_tokens:
            return
        pool.evict_blocks((block,))
        key_block(pool, block, key, manager.group_id, num_tokens)
        manager.cached_this_step.add(key)
        return
    if pool._gid[block] >= 0 or (request_id, num_tokens) in manager.published_tail:
        return
    key_block(pool, block, key, manager.group_id, num_tokens)
    manager.published_tail.add((request_id, num_tokens))
    manager.producer_tail[request_id] = (block, num_tokens)
    manager.cached_this_step.add(key)
    manager.partial_hit[request_id] = (column, block)
    if manager.num_cached_blocks[request_id] > column:
        manager.num_cached_blocks[request_id] = column
