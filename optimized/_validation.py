"""Argument validation of the manager facade, kept apart from the work.

Each function raises a typed error from ``pagedkv.spec.errors`` or returns
what the caller needs; none changes state, so every public operation
validates completely before it mutates anything ("Error behaviour").
"""

from __future__ import annotations

from math import gcd, lcm
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
from pagedkv.spec.registry import manager_kind_for
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
    retention_interval: object = None,
) -> tuple[tuple[int, ...], int | None]:
    """Check the manager's arguments; return the block size of each group
    and the hash block size (``None`` with zero groups: no hashing; by
    default the GCD of the block sizes, D-HASH-5).

    Raises:
        InvalidConfigError: max_model_len, world sizes, hash_block_size or
            retention_interval malformed; context parallelism with a group
            other than full attention.
        InvalidArgumentError: unknown hash_fn.
    """
    _positive_int("max_model_len", max_model_len)
    _positive_int("dcp_world_size", dcp_world_size)
    _positive_int("pcp_world_size", pcp_world_size)
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise InvalidConfigError(
            f"kv_cache_config must be a KVCacheConfig, got {type(kv_cache_config).__name__}")
    assert type(dcp_world_size) is int and type(pcp_world_size) is int
    scale = dcp_world_size * pcp_world_size
    groups = kv_cache_config.kv_cache_groups
    if scale > 1:
        for group_id, group in enumerate(groups):
            if manager_kind_for(group.kv_cache_spec) not in ("full_attention", "sink_full_attention"):
                raise InvalidConfigError(
                    f"kv_cache_groups[{group_id}]: context parallelism supports full attention "
                    f"only, got {type(group.kv_cache_spec).__name__}")
    normalize_hash_fn(hash_fn)
    block_sizes = tuple(group.kv_cache_spec.block_size * scale for group in groups)
    if hash_block_size is None and block_sizes:
        hash_block_size = gcd(*block_sizes)
    if hash_block_size is not None and (type(hash_block_size) is not int or hash_block_size < 1 or any(
            size % hash_block_size for size in block_sizes)):
        raise InvalidConfigError(
            f"hash_block_size must be a positive int dividing every group's block size "
            f"{list(block_sizes)}, got {hash_block_size!r}")
    alignment = lcm(*block_sizes) if block_sizes else 1
    if retention_interval is not None and (type(retention_interval) is not int
                                           or retention_interval < 0
                                           or retention_interval % alignment):
        raise InvalidConfigError(
            f"retention_interval must be None, 0 or a positive multiple of the hit alignment "
            f"{alignment}, got {retention_interval!r}")
    assert hash_block_size is None or type(hash_block_size) is int
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
                        computed: tuple[list[int], ...]) -> None:
    """A hit handed back must still cache the request's positions: block
    ``i`` of group ``g`` (null blocks aside) carries group ``g``'s view of
    ``block_hashes`` at ``i``. A block evicted or reallocated since
    ``get_computed_blocks`` would hand the request another prefix's KV.

    Cost: O(hit blocks) (plus the views of groups hashed at a larger size).

    Raises:
        InvalidArgumentError: a hit block no longer caches its position.
    """
    pool = manager.block_pool
    hashes, group_ids = pool.block_hashes, pool.block_group_ids
    coordinator = manager.coordinator
    views = coordinator.views(request.block_hashes)
    for group_id, group in enumerate(computed):
        if not group:
            continue
        view = views.at(coordinator.block_sizes[group_id])
        for index, block in enumerate(group):
            if not block:
                continue
            if (index >= len(view) or hashes[block] != view[index]
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
    """Check ``allocate_slots``'s arguments, in the reference's order (so
    both raise the same error first); return the prefix-hit block lists per
    group (``None`` when no hit was passed).

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
    num_groups = manager.num_kv_cache_groups
    computed: tuple[list[int], ...] | None = None
    has_hits = False
    if new_computed_blocks is not None:
        computed = _block_lists(new_computed_blocks)
        if len(computed) != num_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks has {len(computed)} groups, the manager has {num_groups}")
        has_hits = any(computed)
    if known_request and (num_new_computed_tokens or has_hits):
        raise InvalidArgumentError(
            f"request {request_id!r} already holds blocks: it cannot take new prefix hits")
    if not manager.enable_caching and (num_new_computed_tokens or has_hits):
        raise InvalidArgumentError("prefix caching is disabled: no computed blocks can be passed")
    encoder = manager.coordinator.encoder_groups
    for group_id, block_size in enumerate(manager.block_sizes):
        held = len(computed[group_id]) if computed is not None else 0
        expected = 0 if encoder[group_id] else num_new_computed_tokens // block_size
        if num_new_computed_tokens % block_size or held != expected:
            raise InvalidArgumentError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match the "
                f"{held} computed blocks of group {group_id} (block size {block_size})")
    if num_groups == 0 and num_new_computed_tokens:
        raise InvalidArgumentError("a model without KV cache groups has no computed blocks")
    if has_hits:
        assert computed is not None
        num_blocks = manager.block_pool.num_blocks
        for group in computed:
            for block in group:
                if type(block) is not int or not 0 <= block < num_blocks:
                    raise UnknownBlockError(
                        f"new_computed_blocks: block id must be an int in "
                        f"[0, {num_blocks}), got {block!r}")
        _check_hit_is_fresh(manager, request, computed)
    total = (request.num_computed_tokens + num_new_computed_tokens
             + num_external_computed_tokens + num_new_tokens)
    if total > manager.max_model_len:
        raise ExceedsMaxModelLenError(
            f"request {request_id!r} would hold {total} tokens, max_model_len is "
            f"{manager.max_model_len}")
    hash_block_size = manager.hash_block_size
    if manager.enable_caching and not delay_cache_blocks and hash_block_size is not None:
        # cache_blocks runs after the allocation; check its precondition now
        # so that no error can follow a state change.
        num_full = min(total, request.num_tokens) // hash_block_size
        if num_full > len(request.block_hashes):
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_full} full blocks to cache but only "
                f"{len(request.block_hashes)} block hashes")
    return computed
