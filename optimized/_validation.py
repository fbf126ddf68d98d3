"""Argument validation of the manager facade, kept apart from the work.

Each function raises a typed error from ``pagedkv.spec.errors`` or returns
what the caller needs; none changes state, so every public operation
validates completely before it mutates anything ("Error behaviour").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTokenCountError,
    UnknownBlockError,
    UnknownRequestError,
)
from pagedkv.spec.hashing import normalize_hash_fn
from pagedkv.spec.request import RequestView

from .blocks import KVCacheBlocks
from .coordinator import KVCacheCoordinator

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["constructor_args", "allocate_args", "known"]


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")


def constructor_args(
    kv_cache_config: KVCacheConfig, max_model_len: object, enable_caching: bool,
    hash_fn: str, hash_block_size: object, dcp_world_size: object, pcp_world_size: object,
) -> tuple[tuple[int, ...], int | None]:
    """Check the manager's arguments; return the block size of each group
    and the hash block size (``None`` with zero groups: no hashing).

    Raises:
        InvalidConfigError: max_model_len, world sizes or hash_block_size
            malformed, or hash_block_size differing from the block size with
            caching on (this slice hashes at the block size).
        InvalidArgumentError: unknown hash_fn.
    """
    _positive_int("max_model_len", max_model_len)
    _positive_int("dcp_world_size", dcp_world_size)
    _positive_int("pcp_world_size", pcp_world_size)
    normalize_hash_fn(hash_fn)
    if hash_block_size is not None:
        _positive_int("hash_block_size", hash_block_size)
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise InvalidConfigError(
            f"kv_cache_config must be a KVCacheConfig, got {type(kv_cache_config).__name__}")
    assert type(dcp_world_size) is int and type(pcp_world_size) is int
    scale = dcp_world_size * pcp_world_size
    block_sizes = tuple(group.kv_cache_spec.block_size * scale
                        for group in kv_cache_config.kv_cache_groups)
    if not block_sizes:
        return block_sizes, None
    if hash_block_size is None:
        return block_sizes, block_sizes[0]
    assert type(hash_block_size) is int
    if enable_caching and len(block_sizes) == 1 and hash_block_size != block_sizes[0]:
        raise InvalidConfigError(
            f"hash_block_size must equal the block size {block_sizes[0]} with prefix caching "
            f"(hashing at another granularity comes with hybrid support), got {hash_block_size}")
    return block_sizes, hash_block_size


def known(coordinator: KVCacheCoordinator, request_id: str) -> None:
    """Raise unless ``request_id`` holds an allocation.

    Raises:
        UnknownRequestError: it does not.
    """
    if request_id not in coordinator.requests:
        raise UnknownRequestError(
            f"request {request_id!r} holds no allocation (never allocated or already freed)")


def _block_lists(blocks: Any) -> tuple[list[int], ...]:
    if isinstance(blocks, KVCacheBlocks):
        return blocks.blocks
    get_block_ids = getattr(blocks, "get_block_ids", None)
    if get_block_ids is None:
        raise InvalidArgumentError(
            f"new_computed_blocks must be KVCacheBlocks or None, got {type(blocks).__name__}")
    return tuple(list(group) for group in get_block_ids())


def _check_hit_is_fresh(manager: KVCacheManager, request: RequestView,
                        computed: tuple[list[int], ...] | None) -> None:
    """A hit handed back must still cache the request's positions: block
    ``i`` of group ``g`` carries ``block_hashes[i]`` in group ``g``. A block
    evicted or reallocated since ``get_computed_blocks`` would hand the
    request another prefix's KV.

    Cost: O(hit blocks).

    Raises:
        InvalidArgumentError: a hit block no longer caches its position.
    """
    assert computed is not None
    pool = manager.block_pool
    hashes, group_ids = pool.block_hashes, pool.block_group_ids
    block_hashes = request.block_hashes
    for group_id, group in enumerate(computed):
        for index, block in enumerate(group):
            if (index >= len(block_hashes) or hashes[block] != block_hashes[index]
                    or group_ids[block] != group_id):
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: stale new_computed_blocks: group "
                    f"{group_id} position {index}: block {block} no longer caches that "
                    f"position (evicted or reused since get_computed_blocks)")


def allocate_args(
    manager: KVCacheManager, request: RequestView, known_request: bool, num_new_tokens: int,
    num_new_computed_tokens: int, new_computed_blocks: Any, num_lookahead_tokens: int,
    num_external_computed_tokens: int, delay_cache_blocks: bool, num_encoder_tokens: int,
) -> tuple[list[int], ...] | None:
    """Check ``allocate_slots``'s arguments; return the prefix-hit block
    lists per group (``None`` when no hit was passed).

    Cost: O(groups + hit blocks).

    Raises:
        InvalidTokenCountError, InvalidArgumentError, UnknownBlockError,
        ExceedsMaxModelLenError: see ``KVCacheManager.allocate_slots``.
    """
    if type(num_new_tokens) is not int or num_new_tokens < 1:
        raise InvalidTokenCountError(f"num_new_tokens must be an int >= 1, got {num_new_tokens!r}")
    for name, value in (("num_new_computed_tokens", num_new_computed_tokens),
                        ("num_lookahead_tokens", num_lookahead_tokens),
                        ("num_external_computed_tokens", num_external_computed_tokens),
                        ("num_encoder_tokens", num_encoder_tokens),
                        ("request.num_computed_tokens", request.num_computed_tokens)):
        if type(value) is not int or value < 0:
            raise InvalidTokenCountError(f"{name} must be an int >= 0, got {value!r}")
    request_id = request.request_id
    computed: tuple[list[int], ...] | None = None
    num_hit_blocks = 0
    if new_computed_blocks is not None:
        computed = _block_lists(new_computed_blocks)
        if len(computed) != manager.num_kv_cache_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks has {len(computed)} groups, the manager has "
                f"{manager.num_kv_cache_groups}")
        num_hit_blocks = len(computed[0]) if computed else 0
        if any(computed):
            if known_request:
                raise InvalidArgumentError(
                    f"request {request_id!r} already holds blocks: it cannot take "
                    f"new_computed_blocks")
            if not manager.enable_caching:
                raise InvalidArgumentError(
                    "new_computed_blocks given but prefix caching is disabled")
            num_blocks = manager.block_pool.num_blocks
            for group in computed:
                for block in group:
                    if type(block) is not int or not 0 < block < num_blocks:
                        raise UnknownBlockError(
                            f"new_computed_blocks: block id must be an int in "
                            f"[1, {num_blocks}), got {block!r}")
    if num_new_computed_tokens:
        if known_request:
            raise InvalidArgumentError(
                f"request {request_id!r} already holds blocks: num_new_computed_tokens must "
                f"be 0, got {num_new_computed_tokens}")
        if not manager.enable_caching:
            raise InvalidArgumentError(
                f"num_new_computed_tokens must be 0 with prefix caching disabled, got "
                f"{num_new_computed_tokens}")
    expected = num_hit_blocks * manager.block_sizes[0] if manager.block_sizes else 0
    if num_new_computed_tokens != expected:
        raise InvalidArgumentError(
            f"num_new_computed_tokens must equal the tokens of new_computed_blocks "
            f"({expected}), got {num_new_computed_tokens}")
    if num_hit_blocks:
        _check_hit_is_fresh(manager, request, computed)
    total = (request.num_computed_tokens + num_new_computed_tokens
             + num_external_computed_tokens + num_new_tokens)
    if total > manager.max_model_len:
        raise ExceedsMaxModelLenError(
            f"request {request_id!r} would hold {total} tokens, max_model_len is "
            f"{manager.max_model_len}")
    if manager.enable_caching and not delay_cache_blocks and manager.block_sizes:
        # cache_blocks runs after the allocation; check its precondition now
        # so that no error can follow a state change.
        num_full = min(total, request.num_tokens) // manager.block_sizes[0]
        if num_full > len(request.block_hashes):
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_full} full blocks to cache but only "
                f"{len(request.block_hashes)} block hashes")
    return computed
