"""Argument validation of the reference manager: the one place this
implementation checks an operation's arguments (the twin of
``optimized/validation.py``, same functions, same order of checks).

Each function raises a typed error from ``pagedkv.spec.errors`` or returns
what the caller needs; none changes state, so a refused operation changes
nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.reference import rules
from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.reference.blocks import KVCacheBlocks
from pagedkv.reference.cross_attention import CrossAttentionManager
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTokenCountError,
    UnknownRequestError,
)
from pagedkv.spec.hashing import normalize_hash_fn
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.request import RequestView

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["count", "constructor_args", "allocate_args", "cache_blocks_args", "known"]


def count(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int ``>= minimum``.

    Raises:
        InvalidTokenCountError: it is not.
    """
    if type(value) is not int or value < minimum:
        raise InvalidTokenCountError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def constructor_args(*, kv_cache_config: KVCacheConfig, max_model_len: object, hash_fn: str,
                     hash_block_size: object, dcp_world_size: object, pcp_world_size: object,
                     retention_interval: object,
                     max_num_batched_tokens: object) -> tuple[list[int], int | None]:
    """Check the manager's arguments; return each group's block size and the
    hash block size (default: the GCD of the block sizes, D-HASH-5; ``None``
    with zero groups).

    Raises:
        InvalidConfigError: a malformed size or count, context parallelism
            with a group other than full attention.
        InvalidArgumentError: unknown ``hash_fn``.
    """
    if type(max_model_len) is not int or max_model_len < 1:
        raise InvalidConfigError(f"max_model_len must be a positive int, got {max_model_len!r}")
    for name, size in (("dcp_world_size", dcp_world_size), ("pcp_world_size", pcp_world_size)):
        if type(size) is not int or size < 1:
            raise InvalidConfigError(f"{name} must be a positive int, got {size!r}")
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise InvalidConfigError(
            f"kv_cache_config must be a KVCacheConfig, got {type(kv_cache_config).__name__}")
    assert type(dcp_world_size) is int and type(pcp_world_size) is int
    groups = kv_cache_config.kv_cache_groups
    if dcp_world_size * pcp_world_size > 1:
        for group_id, group in enumerate(groups):
            if manager_kind_for(group.kv_cache_spec) not in ("full_attention", "sink_full_attention"):
                raise InvalidConfigError(
                    f"kv_cache_groups[{group_id}]: context parallelism supports full attention only, "
                    f"got {type(group.kv_cache_spec).__name__}")
    normalize_hash_fn(hash_fn)
    block_sizes = [group.kv_cache_spec.block_size * dcp_world_size * pcp_world_size for group in groups]
    if hash_block_size is None and block_sizes:
        hash_block_size = rules.hash_block_size(block_sizes)
    if hash_block_size is not None and (type(hash_block_size) is not int or hash_block_size < 1 or any(
            size % hash_block_size for size in block_sizes)):
        raise InvalidConfigError(
            f"hash_block_size must be a positive int dividing every group's block size "
            f"{block_sizes}, got {hash_block_size!r}")
    alignment = rules.hit_alignment(block_sizes)
    if retention_interval is not None and (type(retention_interval) is not int or retention_interval < 0
                                           or retention_interval % alignment):
        raise InvalidConfigError(
            f"retention_interval must be None, 0 or a positive multiple of the hit alignment "
            f"{alignment}, got {retention_interval!r}")
    if max_num_batched_tokens is not None and (type(max_num_batched_tokens) is not int
                                               or max_num_batched_tokens < 1):
        raise InvalidConfigError(
            f"max_num_batched_tokens must be a positive int or None, got {max_num_batched_tokens!r}")
    assert hash_block_size is None or type(hash_block_size) is int
    return block_sizes, hash_block_size


def known(coordinator: KVCacheCoordinator, request_id: str) -> None:
    """Raise unless ``request_id`` holds an allocation.

    Raises:
        UnknownRequestError: it does not.
    """
    if request_id not in coordinator.known:
        raise UnknownRequestError(
            f"request {request_id!r} holds no blocks (never allocated or already freed)")


def allocate_args(*, coordinator: KVCacheCoordinator, request: RequestView, known_request: bool,
                  max_model_len: int, num_new_tokens: int, num_new_computed_tokens: int,
                  new_computed_blocks: KVCacheBlocks | None, num_lookahead_tokens: int,
                  num_external_computed_tokens: int, delay_cache_blocks: bool,
                  num_encoder_tokens: int) -> tuple[tuple[KVCacheBlock, ...], ...]:
    """Step 1 of ``allocate_slots`` (spec/operations.md), checks 1a to 1k in
    order; returns the hit blocks per group (empty without a hit).

    Raises:
        InvalidTokenCountError, InvalidArgumentError, ExceedsMaxModelLenError.
    """
    request_id = request.request_id
    # 1a-1b. counts.
    count("num_new_tokens", num_new_tokens, 1)
    for name, value in (("num_new_computed_tokens", num_new_computed_tokens),
                        ("num_lookahead_tokens", num_lookahead_tokens),
                        ("num_external_computed_tokens", num_external_computed_tokens),
                        ("num_encoder_tokens", num_encoder_tokens),
                        ("request.num_computed_tokens", request.num_computed_tokens)):
        count(name, value, 0)
    # 1c. the hit's shape.
    num_groups = len(coordinator.managers)
    hits: tuple[tuple[KVCacheBlock, ...], ...] = tuple(() for _ in range(num_groups))
    if new_computed_blocks is not None:
        if not isinstance(new_computed_blocks, KVCacheBlocks) or len(new_computed_blocks.blocks) != num_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks must be this manager's KVCacheBlocks with {num_groups} groups")
        hits = new_computed_blocks.blocks
    # 1d. a known request takes no hit.
    if known_request and (num_new_computed_tokens or any(hits)):
        raise InvalidArgumentError(
            f"request {request_id!r} already holds blocks: it cannot take new prefix hits")
    # 1e. no hit without caching.
    if not coordinator.enable_caching and (num_new_computed_tokens or any(hits)):
        raise InvalidArgumentError("prefix caching is disabled: no computed blocks can be passed")
    # 1f. the hit's size matches num_new_computed_tokens in every group.
    for manager, group_hits in zip(coordinator.managers, hits):
        expected = (0 if isinstance(manager, CrossAttentionManager)
                    else num_new_computed_tokens // manager.block_size)
        if num_new_computed_tokens % manager.block_size or len(group_hits) != expected:
            raise InvalidArgumentError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match the "
                f"{len(group_hits)} computed blocks of group {manager.group_id} "
                f"(block size {manager.block_size})")
    # 1g. zero groups: no computed tokens.
    if num_groups == 0 and num_new_computed_tokens:
        raise InvalidArgumentError("a model without KV cache groups has no computed blocks")
    # 1h (ids inside the pool) holds by construction: hits are this pool's blocks.
    # 1i. the hit is still cached (D-API-8).
    if any(hits):
        stale = coordinator.stale_hit(request.block_hashes, hits)
        if stale is not None:
            raise InvalidArgumentError(f"request {request_id!r}: stale new_computed_blocks: {stale}")
    # 1j. max_model_len.
    num_main_tokens = (request.num_computed_tokens + num_new_computed_tokens
                       + num_external_computed_tokens + num_new_tokens)
    if num_main_tokens > max_model_len:
        raise ExceedsMaxModelLenError(
            f"request {request_id!r} would hold {num_main_tokens} tokens, "
            f"more than max_model_len={max_model_len}")
    # 1k. step 8 (cache) will find the hashes it needs.
    num_tokens_to_cache = min(num_main_tokens, request.num_tokens)
    hash_block_size = coordinator.hash_block_size
    if coordinator.enable_caching and not delay_cache_blocks and num_groups and (
            len(request.block_hashes) < num_tokens_to_cache // hash_block_size):
        raise InvalidArgumentError(
            f"request {request_id!r} has {len(request.block_hashes)} block hashes, needs "
            f"{num_tokens_to_cache // hash_block_size} to cache its full blocks")
    return hits


def cache_blocks_args(*, coordinator: KVCacheCoordinator, request: RequestView,
                      num_computed_tokens: int) -> None:
    """Check the public ``cache_blocks``'s arguments: a known request, a
    count, and in every caching group the blocks and hashes the count fills.

    Raises:
        UnknownRequestError, InvalidTokenCountError, InvalidArgumentError.
    """
    known(coordinator, request.request_id)
    count("num_computed_tokens", num_computed_tokens, 0)
    for manager in coordinator.managers:
        if isinstance(manager, CrossAttentionManager):
            continue
        num_full = num_computed_tokens // manager.block_size
        held = len(manager.req_to_blocks[request.request_id])
        hashes = len(request.block_hashes) * coordinator.hash_block_size // manager.block_size
        if num_full > held or num_full > hashes:
            raise InvalidArgumentError(
                f"cannot cache {num_full} full blocks of request {request.request_id!r} in group "
                f"{manager.group_id}: it holds {held} blocks and hashes for {hashes}")
