"""The reference's argument checks (the twin of ``optimized/validation.py``,
same order); the checks that read no block are ``pagedkv.spec``'s. Each
raises a typed error or returns what the caller needs, and changes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.reference.block_pool import KVCacheBlock, KVCacheBlocks
from pagedkv.reference.cross_attention import CrossAttentionManager
from pagedkv.reference.single_type import FullAttentionManager
from pagedkv.spec.allocate_args import check_counts, check_hit_allowed, check_max_model_len, count
from pagedkv.spec.errors import InvalidArgumentError, UnknownBlockError, UnknownRequestError
from pagedkv.spec.request import RequestView

if TYPE_CHECKING:
    from pagedkv.reference.coordinator import KVCacheCoordinator

__all__ = ["count", "allocate_args", "cache_blocks_args", "known"]


def known(coordinator: KVCacheCoordinator, request_id: str) -> None:
    """Raise ``UnknownRequestError`` unless ``request_id`` holds an allocation."""
    try:
        is_known = request_id in coordinator.known
    except TypeError:
        raise InvalidArgumentError(f"request_id must be a str, got {request_id!r}") from None
    if not is_known:
        raise UnknownRequestError(f"request {request_id!r} holds no blocks (never allocated or already freed)")


def allocate_args(*, coordinator: KVCacheCoordinator, request: RequestView, known_request: bool,
                  max_model_len: int, num_new_tokens: int, num_new_computed_tokens: int,
                  new_computed_blocks: KVCacheBlocks | None, num_lookahead_tokens: int,
                  num_external_computed_tokens: int, num_encoder_tokens: int, reserved_blocks: int,
                  num_in_flight_tokens: int, watermark_blocks: int) -> tuple[tuple[KVCacheBlock, ...], ...]:
    """ALLOC-1, checks 1a to 1k in order; returns the hit blocks per group.
    Raises ``InvalidTokenCountError``, ``InvalidArgumentError``, ``ExceedsMaxModelLenError``."""
    request_id, num_groups = request.request_id, len(coordinator.managers)
    check_counts(request, known_request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,  # 1a-1b″
                 num_external_computed_tokens, num_encoder_tokens, reserved_blocks, num_in_flight_tokens,
                 watermark_blocks)
    # 1c. the hit's shape.
    hits: tuple[tuple[KVCacheBlock, ...], ...] = tuple(() for _ in range(num_groups))
    if new_computed_blocks is not None:
        if not isinstance(new_computed_blocks, KVCacheBlocks) or len(new_computed_blocks.blocks) != num_groups:
            raise InvalidArgumentError(f"new_computed_blocks must be this manager's KVCacheBlocks with "
                                       f"{num_groups} groups")
        hits = new_computed_blocks.blocks
    # 1d, 1e, 1g. a hit only for a new request, with caching, with groups.
    check_hit_allowed(request_id, known_request, coordinator.enable_caching, num_groups,
                      num_new_computed_tokens, any(hits))
    # 1f. the hit's size in every group; none outside prefix caching (PFX-1).
    for manager, group_hits, cacheable in zip(coordinator.managers, hits, coordinator.cacheable):
        if isinstance(manager, CrossAttentionManager) or not cacheable:
            fits = len(group_hits) == 0 and (not cacheable or num_new_computed_tokens % manager.block_size == 0)
        else:  # whole blocks, or a shape a feature accepts (H4)
            fits = (num_new_computed_tokens % manager.block_size == 0
                    and len(group_hits) == num_new_computed_tokens // manager.block_size) or any(
                feature.accepts_hit(coordinator, manager, num_new_computed_tokens, len(group_hits),
                                    num_external_computed_tokens) for feature in coordinator.features)
        if not fits:
            raise InvalidArgumentError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match the {len(group_hits)} computed "
                f"blocks of group {manager.group_id} (block size {manager.block_size})")
    pool = coordinator.block_pool
    for manager, group_hits in zip(coordinator.managers, hits):
        for index, block in enumerate(group_hits):  # 1h. this pool's blocks, no null full-attention block (D-API-23)
            block_id = getattr(block, "block_id", None)
            if type(block_id) is not int or not 0 <= block_id < pool.num_blocks or pool.blocks[block_id] is not block:
                raise UnknownBlockError(f"new_computed_blocks: block id must be an int in [0, {pool.num_blocks}) "
                                        f"naming a block of this pool, got {block_id!r}")
            if block.is_null and isinstance(manager, FullAttentionManager):
                raise InvalidArgumentError(f"new_computed_blocks: group {manager.group_id} position {index} is the "
                                           "null block, which a full-attention hit never holds (D-API-23)")
    for manager, group_hits in zip(coordinator.managers, hits):  # 1i. the hit is still cached (D-API-8)
        view = coordinator.view(manager, request.block_hashes) if group_hits else []
        for index, block in enumerate(group_hits):
            if not block.is_null and not manager.holds_hit(request.block_hashes, view, index, block):
                raise InvalidArgumentError(
                    f"request {request_id!r}: stale new_computed_blocks: group {manager.group_id} position {index}: "
                    f"block {block.block_id} no longer caches that position (evicted or reused since "
                    "get_computed_blocks)")
    # 1j. max_model_len.
    check_max_model_len(request_id, request.num_computed_tokens + num_new_computed_tokens
                        + num_external_computed_tokens + num_new_tokens, max_model_len)
    # 1k (withdrawn): missing block hashes only defer caching (D-API-11).
    return hits


def cache_blocks_args(coordinator: KVCacheCoordinator, request: RequestView, num_computed_tokens: int) -> None:
    """``cache_blocks``' arguments: a known request, a count, the blocks it fills.
    Raises ``UnknownRequestError``, ``InvalidTokenCountError``, ``InvalidArgumentError``."""
    known(coordinator, request.request_id)
    count("num_computed_tokens", num_computed_tokens, 0)
    for manager in coordinator.managers:
        num_full = num_computed_tokens // manager.block_size
        held = len(manager.req_to_blocks[request.request_id])
        if num_full > held and not isinstance(manager, CrossAttentionManager):  # missing hashes only defer (D-API-11)
            raise InvalidArgumentError(
                f"num_computed_tokens={num_computed_tokens} fills {num_full} blocks of request "
                f"{request.request_id!r} in group {manager.group_id}, but it holds {held} blocks")
