"""Plain value types of the block manager: hashes, events, statistics.

Block hashes are ``bytes`` (a digest). A hash *with group id* appends the KV
cache group id as four big-endian bytes, so the same tokens cached for two
groups are two different cache keys (spec/hashing.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType, TypeAlias

__all__ = [
    "BlockHash",
    "BlockHashWithGroupId",
    "make_block_hash_with_group_id",
    "get_block_hash",
    "get_group_id",
    "MEDIUM_GPU",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVCacheEvent",
    "PrefixCacheStats",
]

BlockHash = NewType("BlockHash", bytes)
"""Digest of one full block of tokens, chained on its parent's digest."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""A :data:`BlockHash` followed by the group id (4 bytes, big-endian)."""

_GROUP_ID_BYTES = 4

MEDIUM_GPU = "GPU"
"""The medium every event of the device block pool names."""


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The prefix-cache key of ``block_hash`` in KV cache group ``group_id``."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The block hash part of a cache key."""
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group id part of a cache key."""
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became prefix-cache entries: by default one event per
    ``cache_full_blocks`` call, as vLLM; with ``block_stored_events="per_run"``
    one per run of consecutive positions it newly cached, none when it cached
    nothing (spec/operations.md, ``cache_full_blocks``; D-EVT-15).

    ``token_ids`` are the tokens of every block in the range (the call's or
    the run's), ``parent_block_hash`` is the hash of the block before the
    range (``None`` when the range starts at the request's first block).

    With these a consumer recomputes ``block_hashes`` (spec/hashing.md
    section 8): ``extra_keys`` holds each block's extra keys as hashed (over
    the block and its lookahead tokens), ``None`` when no block has any;
    ``lookahead_token_ids`` the tokens after each block its hash covers,
    ``None`` without lookahead hashing.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # vLLM 0.33's routing fields (D-EVT-10): the KV cache group the blocks
    # belong to and the session of the request that stored them (a label of
    # the storing request only: the same blocks may serve other sessions).
    group_idx: int | None = None
    session_id: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block lost its hash (evicted on reuse or by ``evict_blocks``).

    ``group_idx`` is the KV cache group whose key was dropped (D-EVT-12).
    """

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` dropped every hash."""


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``make_prefix_cache_stats()``.

    ``requests``/``queries``/``hits`` count first-time lookups (tokens asked
    for, tokens found); the ``preempted_*`` fields count lookups of requests
    that were preempted before. ``reset`` is set when the prefix cache was
    reset in the interval, so consumers drop their history.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one lookup of ``num_tokens`` tokens that found ``num_hits``."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits
