"""Argument validation of the manager facade: the one place the optimized
implementation checks an operation's arguments (``pagedkv.reference`` has
its twin, ``reference/validation.py``, with the same functions). The
constructor's arguments are checked by the shared
:func:`pagedkv.spec.manager_args.check_manager_args`.

Each function raises a typed error from ``pagedkv.spec.errors`` or returns
what the caller needs; none changes state, so every public operation
validates completely before it mutates anything ("Error behaviour"). The
functions read the coordinator's public tables; they never see the facade.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    InvalidArgumentError,
    InvalidTokenCountError,
    UnknownBlockError,
    UnknownRequestError,
)
from pagedkv.spec.request import RequestView

from .blocks import KVCacheBlocks
from .single_type import FullAttentionManager

if TYPE_CHECKING:
    from .coordinator import KVCacheCoordinator

__all__ = ["allocate_args", "cache_blocks_args", "known", "computed_tokens"]


def known(coordinator: KVCacheCoordinator, request_id: str) -> None:
    """Raise unless ``request_id`` holds an allocation.

    Raises:
        UnknownRequestError: it does not.
    """
    try:
        is_known = request_id in coordinator.requests
    except TypeError:
        raise InvalidArgumentError(f"request_id must be a str, got {request_id!r}") from None
    if not is_known:
        raise UnknownRequestError(
            f"request {request_id!r} holds no allocation (never allocated or already freed)")


def _block_lists(blocks: Any) -> tuple[list[int], ...]:
    # Only this implementation's KVCacheBlocks (D-API-25): a foreign object's
    # get_block_ids() would be engine code run during validation, and its
    # ids are not checked against a pool it came from.
    if not isinstance(blocks, KVCacheBlocks):
        raise InvalidArgumentError(
            f"new_computed_blocks must be this manager's KVCacheBlocks or None, got {type(blocks).__name__}")
    return blocks.blocks


def computed_tokens(*, request: RequestView, known_request: bool) -> None:
    """The request's ``num_computed_tokens`` (an int ``>= 0``) is 0 for a
    request the manager does not know (D-API-21); it may exceed
    ``num_tokens`` for a known one (tokens in flight, D-API-26). Cost: O(1).

    Raises:
        InvalidTokenCountError, InvalidArgumentError.
    """
    computed, num_tokens = request.num_computed_tokens, request.num_tokens
    if type(num_tokens) is not int or num_tokens < 1:
        raise InvalidTokenCountError(f"request.num_tokens must be an int >= 1, got {num_tokens!r}")
    if computed and not known_request:
        raise InvalidArgumentError(
            f"request {request.request_id!r} holds no blocks, so its num_computed_tokens must be 0, "
            f"got {computed} (reset it on free or preemption; a prefix hit goes in "
            f"num_new_computed_tokens) (D-API-21)")


def allocate_args(
    *, coordinator: KVCacheCoordinator, request: RequestView, known_request: bool,
    max_model_len: int, num_new_tokens: int, num_new_computed_tokens: int,
    new_computed_blocks: Any, num_lookahead_tokens: int, num_external_computed_tokens: int,
    delay_cache_blocks: bool, num_encoder_tokens: int, reserved_blocks: int = 0,
    num_in_flight_tokens: int = 0,
) -> tuple[list[int], ...] | None:
    """Step 1 of ``allocate_slots`` (spec/operations.md): check the
    arguments in the spec's order (1a to 1k, the order both implementations
    raise in); return the prefix-hit block lists per group (``None`` when no
    hit was passed).

    Cost: O(groups + hit blocks).

    Raises:
        InvalidTokenCountError, InvalidArgumentError, UnknownBlockError,
        ExceedsMaxModelLenError: see ``KVCacheManager.allocate_slots``.
    """
    # 1a-1b. counts. A call that adopts computed tokens may bring no new one (D-API-12).
    adopting = (type(num_new_computed_tokens) is int and num_new_computed_tokens > 0) or (
        type(num_external_computed_tokens) is int and num_external_computed_tokens > 0)
    if type(num_new_tokens) is not int or num_new_tokens < (0 if adopting else 1):
        raise InvalidTokenCountError(
            f"num_new_tokens must be an int >= 1 (>= 0 when computed tokens are adopted), "
            f"got {num_new_tokens!r}")
    for name, value in (("num_new_computed_tokens", num_new_computed_tokens),
                        ("num_lookahead_tokens", num_lookahead_tokens),
                        ("num_external_computed_tokens", num_external_computed_tokens),
                        ("num_encoder_tokens", num_encoder_tokens),
                        ("reserved_blocks", reserved_blocks),
                        ("num_in_flight_tokens", num_in_flight_tokens),
                        ("request.num_computed_tokens", request.num_computed_tokens)):
        if type(value) is not int or value < 0:
            raise InvalidTokenCountError(f"{name} must be an int >= 0, got {value!r}")
    # 1b, continued: the request's own count (spec/operations.md Part E).
    computed_tokens(request=request, known_request=known_request)
    request_id = request.request_id
    num_groups = len(coordinator.managers)
    enable_caching = coordinator.enable_caching
    # 1c. the hit's shape.
    computed: tuple[list[int], ...] | None = None
    has_hits = False
    if new_computed_blocks is not None:
        computed = _block_lists(new_computed_blocks)
        if len(computed) != num_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks has {len(computed)} groups, the manager has {num_groups}")
        has_hits = any(computed)
    # 1d. a known request takes no hit.
    if known_request and (num_new_computed_tokens or has_hits):
        raise InvalidArgumentError(
            f"request {request_id!r} already holds blocks: it cannot take new prefix hits "
            f"(new_computed_blocks, num_new_computed_tokens)")
    # 1e. no hit without caching.
    if not enable_caching and (num_new_computed_tokens or has_hits):
        raise InvalidArgumentError("prefix caching is disabled: no computed blocks can be passed")
    # 1f. the hit's size matches num_new_computed_tokens in every group.
    encoder = coordinator.encoder_groups
    for group_id, block_size in enumerate(coordinator.block_sizes):
        held = len(computed[group_id]) if computed is not None else 0
        expected = 0 if encoder[group_id] else num_new_computed_tokens // block_size
        if num_new_computed_tokens % block_size or held != expected:
            raise InvalidArgumentError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match the "
                f"{held} computed blocks of group {group_id} (block size {block_size})")
    # 1g. zero groups: no computed tokens.
    if num_groups == 0 and num_new_computed_tokens:
        raise InvalidArgumentError("a model without KV cache groups has no computed blocks")
    if has_hits:
        assert computed is not None
        # 1h. hit ids inside the pool.
        num_blocks = coordinator.block_pool.num_blocks
        for group_id, group in enumerate(computed):
            no_null = isinstance(coordinator.managers[group_id], FullAttentionManager)
            for index, block in enumerate(group):
                if type(block) is not int or not 0 <= block < num_blocks:
                    raise UnknownBlockError(
                        f"new_computed_blocks: block id must be an int in [0, {num_blocks}) naming a "
                        f"block of this pool, got {block!r}")
                if not block and no_null:
                    raise InvalidArgumentError(
                        f"new_computed_blocks: group {group_id} position {index} is the null "
                        f"block, which a full-attention hit never holds (D-API-23)")
        # 1i. the hit is still cached (D-API-8).
        stale = coordinator.stale_hit(request.block_hashes, computed)
        if stale is not None:
            raise InvalidArgumentError(f"request {request_id!r}: stale new_computed_blocks: {stale}")
    # 1j. max_model_len.
    total = (request.num_computed_tokens + num_new_computed_tokens
             + num_external_computed_tokens + num_new_tokens)
    if total > max_model_len:
        raise ExceedsMaxModelLenError(
            f"request {request_id!r} would hold {total} tokens, max_model_len is "
            f"{max_model_len}")
    # 1k (withdrawn): missing block hashes only defer caching (D-API-11).
    return computed


def cache_blocks_args(*, coordinator: KVCacheCoordinator, request: RequestView,
                      num_computed_tokens: int) -> None:
    """Check the public ``cache_blocks``'s arguments: a known request, a
    count, and in every group (cross-attention aside) the blocks and hashes
    ``num_computed_tokens`` fill. Cost: O(groups).

    Raises:
        UnknownRequestError: the request holds no allocation.
        InvalidTokenCountError: ``num_computed_tokens`` is not an int >= 0.
        InvalidArgumentError: a group holds fewer blocks.
    """
    request_id = request.request_id
    known(coordinator, request_id)
    if type(num_computed_tokens) is not int or num_computed_tokens < 0:
        raise InvalidTokenCountError(
            f"num_computed_tokens must be an int >= 0, got {num_computed_tokens!r}")
    for group_id, manager in enumerate(coordinator.managers):
        if coordinator.encoder_groups[group_id]:
            continue  # cross-attention blocks are never cached
        block_size = manager.block_size
        blocks = manager.req_to_blocks[request_id]
        num_full = num_computed_tokens // block_size
        if num_full > len(blocks):  # missing hashes only defer caching (D-API-11)
            raise InvalidArgumentError(
                f"num_computed_tokens={num_computed_tokens} fills {num_full} blocks of request "
                f"{request_id!r} in group {group_id}, but it holds {len(blocks)} blocks")
