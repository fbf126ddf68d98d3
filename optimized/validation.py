"""Argument validation of the manager facade: the one place the optimized
implementation checks an operation's arguments (``pagedkv.reference`` has
its twin, ``reference/validation.py``, with the same functions). The
constructor's arguments are checked by the shared
:func:`pagedkv.spec.manager_args.check_manager_args`, and the checks of
``allocate_slots`` that read no block by :mod:`pagedkv.spec.allocate_args`.

Each function raises a typed error from ``pagedkv.spec.errors`` or returns
what the caller needs; none changes state, so every public operation
validates completely before it mutates anything ("Error behaviour"). The
functions read the coordinator's public tables; they never see the facade.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.single_type import FullAttentionManager
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.optimized.rules.connector_hits import connector_completes_state
from pagedkv.optimized.rules.mamba_partial_rules import hit_fits
from pagedkv.spec.allocate_args import check_counts, check_hit_allowed, check_max_model_len, count
from pagedkv.spec.errors import InvalidArgumentError, UnknownBlockError, UnknownRequestError
from pagedkv.spec.request import RequestView
from pagedkv.spec.types import BlockHash

if TYPE_CHECKING:
    from pagedkv.optimized.coordination.coordinator import KVCacheCoordinator

__all__ = ["allocate_args", "cache_blocks_args", "known"]


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


def _hit_holds(coordinator: KVCacheCoordinator, block_hashes: Sequence[BlockHash],
               computed: tuple[list[int], ...]) -> bool:
    """Whether the hit passes checks 1h, 1h′ and 1i at once, decided with
    whole-list operations (the common case: a hit handed back untouched
    from ``get_computed_blocks``). ``False`` means "not shown here": the
    caller then runs the checks one by one, in the spec's order, which
    decide the error. ``True`` only when every group's blocks are ints, a
    leading run of null blocks in a group that can skip positions (not full
    attention: check 1h′) and after it each the block the group's map serves
    for the request's hash of its position (the one a lookup returns): such
    a block lies in the pool, is not the null block and carries that key in
    that group (CACHE-1).
    Cost: O(hit blocks), in C loops; it reads the map's int values, not
    the blocks' hash objects (a cache miss per block).
    """
    tables = coordinator.block_pool.cached_by_group
    views = None
    for group_id, group in enumerate(computed):
        if not group:
            continue
        held = len(group)
        # Exactly int (a bool or numpy integer compares equal to one).
        if list(map(type, group)).count(int) != held:
            return False
        if views is None:
            views = coordinator.views(block_hashes)
        view = views.at(coordinator.block_sizes[group_id])
        if held > len(view):
            return False
        # A windowed or state group's hit leads with null blocks (skipped
        # positions, allowed where the group can skip one: check 1h'); the
        # blocks after them are checked as any hit's (D-PERF-42).
        skipped = group.count(0)
        if skipped and (isinstance(coordinator.managers[group_id], FullAttentionManager)
                        or group[:skipped] != [0] * skipped):
            return False
        # Null blocks elsewhere, later holders of a duplicated key and stale
        # blocks all differ from the map's value: one by one.
        if list(map(tables[group_id].get, view[skipped:held])) != group[skipped:]:
            return False
    return True


def allocate_args(
    *, coordinator: KVCacheCoordinator, request: RequestView, known_request: bool,
    max_model_len: int, num_new_tokens: int, num_new_computed_tokens: int,
    new_computed_blocks: Any, num_lookahead_tokens: int, num_external_computed_tokens: int,
    delay_cache_blocks: bool, num_encoder_tokens: int, reserved_blocks: int = 0,
    num_in_flight_tokens: int = 0, watermark_blocks: int = 0,
) -> tuple[list[int], ...] | None:
    """ALLOC-1 of ``allocate_slots`` (spec/operations.md): check the
    arguments in the spec's order (1a to 1k, the order both implementations
    raise in; the representation-independent checks are
    :mod:`pagedkv.spec.allocate_args`'s); return the prefix-hit block lists
    per group (``None`` when no hit was passed).

    Cost: O(groups + hit blocks).

    Raises:
        InvalidTokenCountError, InvalidArgumentError, UnknownBlockError,
        ExceedsMaxModelLenError: see ``KVCacheManager.allocate_slots``.
    """
    # 1a-1b″. counts, the request's own counts (Part E).
    check_counts(request, known_request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                 num_external_computed_tokens, num_encoder_tokens, reserved_blocks, num_in_flight_tokens,
                 watermark_blocks)
    request_id = request.request_id
    num_groups = len(coordinator.managers)
    # 1c. the hit's shape.
    computed: tuple[list[int], ...] | None = None
    has_hits = False
    if new_computed_blocks is not None:
        computed = _block_lists(new_computed_blocks)
        if len(computed) != num_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks has {len(computed)} groups, the manager has {num_groups}")
        has_hits = any(computed)
    # 1d, 1e, 1g. a hit only for a new request, with caching, with groups.
    check_hit_allowed(request_id, known_request, coordinator.enable_caching, num_groups,
                      num_new_computed_tokens, has_hits)
    # 1f. the hit's size matches num_new_computed_tokens in every group.
    # A group outside prefix caching takes no hit block, at any length (PFX-1).
    encoder = coordinator.encoder_groups
    cacheable = coordinator.cacheable
    for group_id, block_size in enumerate(coordinator.block_sizes):
        held = len(computed[group_id]) if computed is not None else 0
        if encoder[group_id] or not cacheable[group_id]:
            # A group outside prefix caching takes no hit block, at any length (PFX-1).
            fits = held == 0 and (not cacheable[group_id] or num_new_computed_tokens % block_size == 0)
        else:
            manager = coordinator.managers[group_id]
            sub_block = getattr(manager, "partial_hits", False)
            fits = hit_fits(num_new_computed_tokens, held, block_size, coordinator.hash_block_size, sub_block)
            # A Mamba group may hit shallower when a connector loads the state (D-API-46).
            fits = fits or (isinstance(manager, MambaManager) and connector_completes_state(
                num_new_computed_tokens, held, block_size, coordinator.hash_block_size, sub_block,
                num_external_computed_tokens))
        if not fits:
            raise InvalidArgumentError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match the "
                f"{held} computed blocks of group {group_id} (block size {block_size})")
    if has_hits:
        assert computed is not None
        if not _hit_holds(coordinator, request.block_hashes, computed):
            _hit_blocks_one_by_one(coordinator, request_id, request.block_hashes, computed)
    # 1j. max_model_len.
    check_max_model_len(request_id, request.num_computed_tokens + num_new_computed_tokens
                        + num_external_computed_tokens + num_new_tokens, max_model_len)
    # 1k (withdrawn): missing block hashes only defer caching (D-API-11).
    return computed


def _hit_blocks_one_by_one(coordinator: KVCacheCoordinator, request_id: str,
                           block_hashes: Sequence[BlockHash], computed: tuple[list[int], ...]) -> None:
    """Checks 1h, 1h′ (every block, in order) then 1i, block by block: the
    definition :func:`_hit_holds` shortcuts. Cost: O(hit blocks).

    Raises:
        UnknownBlockError: 1h. InvalidArgumentError: 1h′, 1i.
    """
    # 1h. hit ids inside the pool; 1h′. no null block where the group cannot skip one (D-API-23).
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
    stale = coordinator.stale_hit(block_hashes, computed)
    if stale is not None:
        raise InvalidArgumentError(f"request {request_id!r}: stale new_computed_blocks: {stale}")


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
    count("num_computed_tokens", num_computed_tokens, 0)
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
