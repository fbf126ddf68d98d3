"""Post-conditions the lockstep machines assert after a call ("sm" in
spec/state.md): the invariants that need what ``check_invariants()`` does not
see — the ``Request`` objects, the call's arguments, its result.

Every check reads only public API (``kv_cache_config``, ``block_sizes``,
``hash_block_size``, ``max_model_len``, ``max_num_batched_tokens``,
``get_block_ids``, ``snapshot``), so it runs on any implementation, and on
failure raises :class:`~pagedkv.spec.errors.InvariantViolation` whose message
starts with the invariant's ID, as ``check_invariants()`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.reference.features.mamba_partial_rules import state_key, state_keys_in_block
from pagedkv.spec.attention_variants import RSWASpec, prefix_cacheable
from pagedkv.spec.errors import InvariantViolation
from pagedkv.spec.hashing import ExtraKeys, block_extra_keys, hash_block_tokens, normalize_hash_fn, seed_hash
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.request import Request
from pagedkv.spec.types import BlockHash, make_block_hash_with_group_id

__all__ = ["check_block_hashes", "check_position_keys", "check_hit", "check_allocation", "check_admission_cap",
           "group_view"]

NULL = 0


def _fail(invariant: str, message: str) -> InvariantViolation:
    return InvariantViolation(f"{invariant}: {message}")


def _specs(manager: Any) -> list[KVCacheSpec]:
    return [group.kv_cache_spec for group in manager.kv_cache_config.kv_cache_groups]


def group_view(block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int) -> list[bytes]:
    """A request's hashes at a group's block size (spec/hashing.md §4): a
    group block's hash joins the hashes of the hash blocks it spans."""
    scale = block_size // hash_block_size
    return [b"".join(block_hashes[index * scale:(index + 1) * scale])
            for index in range(len(block_hashes) // scale)]


def check_block_hashes(request: Request, hash_fn: str, hash_block_size: int, hash_seed: str | None,
                       lookahead: int = 0) -> None:
    """HASH-1: the request's block hashes are the chain spec/hashing.md
    defines (with ``lookahead`` tokens after each block, section 7),
    recomputed here from scratch."""
    fn = normalize_hash_fn(hash_fn)
    tokens = request.all_token_ids
    parent: bytes = seed_hash(fn, hash_seed)
    expected: list[bytes] = []
    mm_index = 0
    for index in range(max(0, request.num_tokens - lookahead) // hash_block_size):
        start, end = index * hash_block_size, (index + 1) * hash_block_size
        extra_keys: ExtraKeys
        if lookahead:
            window, _ = block_extra_keys(request, start, end + lookahead, 0)
            extra_keys = (window, *tokens[end:end + lookahead])
        else:
            extra_keys, mm_index = block_extra_keys(request, start, end, mm_index)
        parent = hash_block_tokens(fn, parent, tokens[start:end], extra_keys)
        expected.append(parent)
    if list(request.block_hashes) != expected:
        raise _fail("HASH-1", f"request {request.request_id!r} carries {len(request.block_hashes)} block "
                    f"hashes that are not the {len(expected)} its tokens define")


def check_position_keys(manager: Any, requests: Iterable[Request]) -> None:
    """REQ-7: a hashed block a known request holds carries its own
    position's key. Mamba groups are exempt (state blocks move)."""
    snapshot = manager.snapshot()
    keys = snapshot.pool.block_hashes
    hash_block_size = manager.hash_block_size
    for request in requests:
        lists = manager.get_block_ids(request.request_id)
        for group_id, (spec, blocks) in enumerate(zip(_specs(manager), lists)):
            if isinstance(spec, MambaSpec):
                continue
            if not prefix_cacheable(spec):
                hashed = [block for block in blocks if keys[block] is not None]
                if hashed:
                    raise _fail("PFX-1", f"request {request.request_id!r} group {group_id} is outside "
                                f"prefix caching but holds hashed blocks {hashed}")
                continue
            block_size = manager.block_sizes[group_id]
            view = group_view(request.block_hashes, hash_block_size, block_size)
            # A full-attention block larger than the hash block may carry the
            # partial key of a boundary inside it (FPART-2).
            inside = block_size != hash_block_size and bool(
                getattr(manager.coordinator, "partial_hits_enabled", False))
            for index, block in enumerate(blocks):
                key = keys[block]
                if key is None:
                    continue
                if inside and key in {make_block_hash_with_group_id(partial, group_id) for partial in
                                      state_keys_in_block(request.block_hashes, index, hash_block_size,
                                                          block_size)}:
                    continue
                if index >= len(view) or key != make_block_hash_with_group_id(BlockHash(view[index]), group_id):
                    raise _fail("REQ-7", f"request {request.request_id!r} group {group_id} holds block {block} "
                                f"at position {index} under another position's key {key.hex()}")


def check_hit(manager: Any, request: Request, block_ids: Sequence[Sequence[int]], length: int) -> None:
    """HYB-1 (but maximality, which the machine checks by comparing every
    implementation with the reference's brute-force search) and XATTN-1's
    second half: a prefix hit is aligned, leaves a token to compute, covers
    ``length`` tokens in every group with blocks carrying their positions'
    keys, and takes no cross-attention block."""
    specs = _specs(manager)
    block_sizes = manager.block_sizes
    cacheable = [prefix_cacheable(spec) for spec in specs]
    alignment = math.lcm(*(size for size, c in zip(block_sizes, cacheable) if c)) if any(cacheable) else 1
    # Sub-block hits (MPART-1): any hash boundary; a Mamba group hands the
    # block holding the state, under that boundary's key.
    sub_block = bool(getattr(manager.coordinator, "partial_hits_enabled", False))
    if sub_block:
        alignment = manager.hash_block_size
    if length % alignment or not 0 <= length <= max(0, request.num_tokens - 1) or len(block_ids) != len(specs):
        raise _fail("HYB-1", f"hit of {length} tokens for request {request.request_id!r} "
                    f"({request.num_tokens} tokens, alignment {alignment}, {len(block_ids)} lists)")
    keys = manager.snapshot().pool.block_hashes
    for group_id, (spec, blocks) in enumerate(zip(specs, block_ids)):
        if isinstance(spec, CrossAttentionSpec):
            if blocks:
                raise _fail("XATTN-1", f"group {group_id} contributes {list(blocks)} to a prefix hit")
            continue
        if not cacheable[group_id]:
            if blocks:
                raise _fail("PFX-1", f"group {group_id} is outside prefix caching but contributes "
                            f"{list(blocks)} to a prefix hit")
            continue
        if sub_block and isinstance(spec, MambaSpec) and block_sizes[group_id] != alignment:
            key = state_key(request.block_hashes, length, alignment, block_sizes[group_id])
            if len(blocks) != -(-length // block_sizes[group_id]) or (blocks and (
                    key is None or keys[blocks[-1]] != make_block_hash_with_group_id(key, group_id))):
                raise _fail("HYB-1", f"group {group_id} sub-block hit {list(blocks)} for {length} tokens")
            continue
        if sub_block and block_sizes[group_id] != alignment:
            _check_sub_block_full_hit(request, group_id, list(blocks), length, alignment,
                                      block_sizes[group_id], keys)
            continue
        if len(blocks) * block_sizes[group_id] != length:
            raise _fail("HYB-1", f"group {group_id} hit {len(blocks)} blocks of {block_sizes[group_id]} "
                        f"tokens for a hit of {length}")
        view = group_view(request.block_hashes, manager.hash_block_size, block_sizes[group_id])
        for index, block in enumerate(blocks):
            if block != NULL and keys[block] != make_block_hash_with_group_id(BlockHash(view[index]), group_id):
                raise _fail("HYB-1", f"group {group_id} hit block {block} at position {index} does not carry "
                            "its position's key")


def _check_sub_block_full_hit(request: Request, group_id: int, blocks: list[int], length: int,
                              hash_block_size: int, block_size: int, keys: Sequence[bytes | None]) -> None:
    """HYB-1 for a full-attention group larger than the hash block (FPART-1):
    ``cdiv(L, b)`` blocks, the whole ones under their keys, the last one
    under its own full key or the partial key of a boundary at or past ``L``
    inside it. A tail served through its extra entry (D-MAMBA-22) carries
    the full key of whichever prefix filled it, which a snapshot cannot
    tell apart: a tail is then only checked to carry a full-length key of
    the group."""
    view = group_view(request.block_hashes, hash_block_size, block_size)
    if len(blocks) != -(-length // block_size):
        raise _fail("HYB-1", f"group {group_id} sub-block hit {blocks} for {length} tokens")
    full_length = len(view_key_of(request, block_size, hash_block_size, group_id))
    for index, block in enumerate(blocks):
        key = keys[block]
        if ((index + 1) * block_size > length and key is not None and len(key) == full_length
                and key.endswith(make_block_hash_with_group_id(BlockHash(b""), group_id))):
            continue
        allowed = {make_block_hash_with_group_id(BlockHash(view[index]), group_id)} if index < len(view) else set()
        if (index + 1) * block_size > length:
            allowed |= {make_block_hash_with_group_id(request.block_hashes[boundary // hash_block_size - 1],
                                                      group_id)
                        for boundary in range(length, (index + 1) * block_size, hash_block_size)
                        if boundary // hash_block_size <= len(request.block_hashes)}
        if keys[block] not in allowed:
            raise _fail("HYB-1", f"group {group_id} hit block {block} at position {index} carries no key "
                        f"that serves a hit of {length} tokens")


def view_key_of(request: Request, block_size: int, hash_block_size: int, group_id: int) -> bytes:
    """A full key of the group, for its length: ``block_size / hash_block_size``
    hashes (of the request's first hash's length) and the group id."""
    width = len(request.block_hashes[0]) if request.block_hashes else 32
    return make_block_hash_with_group_id(BlockHash(bytes(width * (block_size // hash_block_size))), group_id)


def _skipped(spec: KVCacheSpec, num_computed: int) -> int | None:
    """Leading tokens no longer read (spec/managers.md); None: the type skips none."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_computed - spec.retained_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size
    return None


def check_allocation(manager: Any, request_id: str, num_total_computed: int, num_new_tokens: int,
                     num_lookahead_tokens: int, num_prompt_tokens: int | None = None) -> None:
    """After ``allocate_slots`` returned (blocks or ``None``) for a request
    that is now known: SKIP-1 (b) and MAMBA-1 (modes ``none``/``all``) —
    the positions attention no longer reads hold the null block — and SWA-1 /
    CHUNK-1 — a windowed group holds no more real blocks than its admission
    cap when the call asked for at most ``max_num_batched_tokens`` tokens
    (lookahead included)."""
    lists = manager.get_block_ids(request_id)
    for group_id, (spec, blocks) in enumerate(zip(_specs(manager), lists)):
        block_size = manager.block_sizes[group_id]
        skipped = _skipped(spec, num_total_computed)
        if skipped is not None:
            dead = min(len(blocks), skipped // block_size)
            if any(block != NULL for block in blocks[:dead]):
                raise _fail("SKIP-1", f"request {request_id!r} group {group_id} still holds {blocks[:dead]} "
                            f"in the {dead} blocks {num_total_computed} computed tokens skip")
        if isinstance(spec, RSWASpec) and num_prompt_tokens is not None:
            # RSWA-1: the prompt's blocks are real, the released gap null.
            first = -(-num_prompt_tokens // block_size)
            end = max(num_prompt_tokens, num_total_computed - spec.rswa_window) // block_size
            if NULL in blocks[:first] or any(block != NULL for block in blocks[first:end]):
                raise _fail("RSWA-1", f"request {request_id!r} group {group_id} holds {blocks}: prompt "
                            f"positions 0..{first - 1} real, gap {first}..{end - 1} null expected")
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode in ("none", "all"):
            dead = min(len(blocks), (num_total_computed - 1) // block_size)
            if any(block != NULL for block in blocks[:max(0, dead)]):
                raise _fail("MAMBA-1", f"request {request_id!r} group {group_id} holds old states "
                            f"{blocks[:dead]} after {num_total_computed} computed tokens")
    check_admission_cap(manager, request_id, num_total_computed, num_new_tokens, num_lookahead_tokens)


def check_admission_cap(manager: Any, request_id: str, num_total_computed: int, num_new_tokens: int,
                        num_lookahead_tokens: int) -> None:
    """SWA-1 / CHUNK-1 after ``allocate_slots``: a windowed group holds no
    more real blocks than its admission cap among the blocks this call's
    tokens reach, when the call asked for at most ``max_num_batched_tokens``
    tokens (lookahead included)."""
    lists = manager.get_block_ids(request_id)
    budget = manager.max_num_batched_tokens
    for group_id, (spec, blocks) in enumerate(zip(_specs(manager), lists)):
        block_size = manager.block_sizes[group_id]
        if num_new_tokens + num_lookahead_tokens <= budget and isinstance(
                spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
            cap = spec.max_admission_blocks_per_request(budget, manager.max_model_len)
            # Blocks an earlier call allocated for a longer lookahead lie past
            # this call's reach and are not this call's admission.
            reach = -(-min(num_total_computed + num_new_tokens + num_lookahead_tokens,
                           manager.max_model_len) // block_size)
            held = sum(1 for block in blocks[:reach] if block != NULL)
            if held > cap:
                invariant = "SWA-1" if isinstance(spec, SlidingWindowSpec) else "CHUNK-1"
                raise _fail(invariant, f"request {request_id!r} group {group_id} holds {held} blocks, "
                            f"over its admission cap {cap}")


def _is_null_block(block: Any) -> bool:
    """The null block in either representation (an object, or block id 0)."""
    return bool(block.is_null) if hasattr(block, "is_null") else block == 0


def mamba_checkpoints(manager: Any) -> list[dict[str, tuple[int, int]]]:
    """Each Mamba group's prefill-checkpoint table (spec/mamba.md), for comparison."""
    return [dict(group.checkpoints) for group in manager.coordinator.managers
            if hasattr(group, "checkpoints")]


def key_token_counts(manager: Any) -> list[int | None]:
    """KEYTOK-1: the tokens each block's key covers (``None`` unkeyed), for
    comparison; a keyed block covers at least one token."""
    pool = manager.block_pool
    counts: list[int | None] = [pool.key_tokens(block) for block in range(pool.num_blocks)]
    for block, count in enumerate(counts):
        if count is not None and count < 1:
            raise _fail("KEYTOK-1", f"block {block} is keyed but its key covers {count} tokens")
    return counts


def check_mamba_checkpoint(manager: Any, request_id: str) -> None:
    """MCKPT-1 right after an allocation: a recorded checkpoint names a real
    block at its column; MCKPT-3: the checkpoint block carries no key or
    the key of its position (KEYTOK-1)."""
    for group in manager.coordinator.managers:
        found = getattr(group, "checkpoints", {}).get(request_id)
        if found is None:
            continue
        position, column = found
        blocks = group.req_to_blocks[request_id]
        if column >= len(blocks) or _is_null_block(blocks[column]):
            raise _fail("MCKPT-1", f"request {request_id!r} group {group.group_id}: checkpoint at "
                        f"{position} reserved column {column} but the block there is null or missing")
        block = blocks[column]
        block_id = block.block_id if hasattr(block, "block_id") else block
        covered = group.block_pool.key_tokens(block_id)
        if covered is not None and covered != position:
            raise _fail("MCKPT-3", f"request {request_id!r} group {group.group_id}: block {block_id} "
                        f"holds the checkpoint at {position} but its key covers {covered} tokens")


def check_offers_dropped(manager: Any, request_id: str) -> None:
    """MOFF-1 after ``free``: no Mamba group still offers the request's blocks."""
    for group in manager.coordinator.managers:
        offers = getattr(group, "offers", ())
        # The reference keeps (request, block, tokens) triples, the optimized
        # manager (block, tokens) pairs by request (D-PERF-36).
        if (offers.get(request_id) if isinstance(offers, dict)
                else any(offer[0] == request_id for offer in offers)):
            raise _fail("MOFF-1", f"group {group.group_id} still offers a block of freed request "
                        f"{request_id!r}")
