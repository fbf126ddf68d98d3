"""EAGLE per KV-cache group (spec/coordinators.md section 4.1, D-SWA-14) and
the hybrid EAGLE peek past the hit cap (section 4, D-SWA-15), with concrete
block ids. One suite over every implementation."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.reference.features.eagle_rules import eagle_group_mask, eagle_peek_limit
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import SlidingWindowSpec

N = 0  # the null block


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 8, "float16")


def window(block_size: int, size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 1, 8, "float32", sliding_window=size)


def make(impl: ModuleType, *groups: tuple[Any, bool], num_blocks: int = 100, **kwargs: Any) -> Any:
    specs = tuple(KVCacheGroupSpec((f"l{i}",), spec, is_eagle_group=marked)
                  for i, (spec, marked) in enumerate(groups))
    return impl.KVCacheManager(KVCacheConfig(num_blocks, (), specs), max_model_len=512,
                               enable_caching=True, **kwargs)


def hashed_positions(manager: Any, request_id: str, group_id: int) -> list[int]:
    hashes = manager.snapshot().pool.block_hashes
    blocks = manager.get_block_ids(request_id)[group_id]
    return [index for index, block in enumerate(blocks) if block != N and hashes[block] is not None]


def test_eagle_group_mask_rule() -> None:
    keys = ["full", "swa", "swa"]
    assert eagle_group_mask([False, False, False], keys, use_eagle=False) == (False, False, False)
    # Nothing marked: every group drafts.
    assert eagle_group_mask([False, False, False], keys, use_eagle=True) == (True, True, True)
    # A marked group carries its same-spec sibling, not the others.
    assert eagle_group_mask([False, False, True], keys, use_eagle=True) == (False, True, True)
    # Marks mean nothing without use_eagle.
    assert eagle_group_mask([True, True, True], keys, use_eagle=False) == (False, False, False)


def test_eagle_peek_limit_rule() -> None:
    assert eagle_peek_limit(127, 128, 1) == 127
    assert eagle_peek_limit(127, 128, 2) == 128
    assert eagle_peek_limit(127, 96, 2) == 127  # never below the cap


def test_is_eagle_group_must_be_a_bool() -> None:
    with pytest.raises(InvalidConfigError, match="is_eagle_group"):
        KVCacheGroupSpec(("l",), full(8), is_eagle_group=1)  # type: ignore[arg-type]


def test_marked_window_group_caches_the_post_boundary_block(impl: ModuleType) -> None:
    """Full 32 + SWA 8 (window 8) marked, 40 tokens: the window group caches
    blocks 3 and 4 (the segment tail and the peek, min(40, 32 + 8)); the
    full group, not an EAGLE group, caches its one whole block. A 41-token
    sibling hits 32: full attention by the plain rule (block ids 1), the
    window group [N, N, N, 5] with block 6 read and given back."""
    manager = make(impl, (full(32), False), (window(8, 8), True), use_eagle=True)
    tokens = [i // 8 for i in range(40)]
    owner = manager.make_request("0", tokens)
    assert manager.allocate_slots(owner, 40) is not None
    assert manager.get_block_ids("0") == ([1, 2], [3, 4, 5, 6, 7])
    assert hashed_positions(manager, "0", 0) == [0]
    assert hashed_positions(manager, "0", 1) == [3, 4]
    manager.free(owner)
    blocks, num_hit = manager.get_computed_blocks(manager.make_request("1", tokens + [999]))
    assert num_hit == 32
    assert blocks.get_block_ids() == ([1], [N, N, N, 6])


def test_unmarked_model_keeps_the_full_group_eagle(impl: ModuleType) -> None:
    """The same model with no group marked: every group drafts, so full
    attention needs a second 32-token block before giving one back and the
    sibling misses."""
    manager = make(impl, (full(32), False), (window(8, 8), False), use_eagle=True)
    tokens = [i // 8 for i in range(40)]
    owner = manager.make_request("0", tokens)
    assert manager.allocate_slots(owner, 40) is not None
    manager.free(owner)
    assert manager.get_computed_blocks(manager.make_request("1", tokens + [999]))[1] == 0


def test_same_spec_siblings_share_the_eagle_cache_mask(impl: ModuleType) -> None:
    """Full 32 + two SWA 8 groups with one spec, only the second marked:
    both window groups cache the block past each 32-token boundary (4 and 8)
    and a 73-token sibling hits 64 in every group."""
    spec = window(8, 8)
    manager = make(impl, (full(32), False), (spec, False), (spec, True), use_eagle=True)
    tokens = [i // 8 for i in range(72)]
    owner = manager.make_request("0", tokens)
    assert manager.allocate_slots(owner, 72) is not None
    assert hashed_positions(manager, "0", 1) == hashed_positions(manager, "0", 2)
    assert {4, 8} <= set(hashed_positions(manager, "0", 1))
    manager.free(owner)
    blocks, num_hit = manager.get_computed_blocks(manager.make_request("1", tokens + [999]))
    assert num_hit == 64
    assert [len(group) for group in blocks.get_block_ids()] == [2, 8, 8]


def test_hybrid_eagle_resend_keeps_its_last_aligned_block(impl: ModuleType) -> None:
    """D-SWA-15: full 32 + SWA 32 (window 32), 128 tokens, all groups
    drafting. A resend's cap is 127; with several groups the full group may
    read block 3 (tokens 96..127) past the cap and give it back, so the hit
    is 96 (block ids 1, 2, 3), not 64."""
    manager = make(impl, (full(32), False), (window(32, 32), False), use_eagle=True)
    tokens = [i // 32 for i in range(128)]
    owner = manager.make_request("0", tokens)
    assert manager.allocate_slots(owner, 128) is not None
    assert manager.get_block_ids("0")[0] == [1, 2, 3, 4]
    manager.free(owner)
    blocks, num_hit = manager.get_computed_blocks(manager.make_request("1", tokens))
    assert num_hit == 96
    assert blocks.get_block_ids()[0] == [1, 2, 3]


def test_one_group_keeps_the_cap(impl: ModuleType) -> None:
    """One full group of 32 with EAGLE, 128 tokens: the peek stays within the
    cap 127, so a resend hits 64 (blocks 1, 2), as vLLM's unitary coordinator."""
    manager = make(impl, (full(32), False), use_eagle=True)
    tokens = list(range(128))
    owner = manager.make_request("0", tokens)
    assert manager.allocate_slots(owner, 128) is not None
    manager.free(owner)
    blocks, num_hit = manager.get_computed_blocks(manager.make_request("1", tokens))
    assert num_hit == 64
    assert blocks.get_block_ids() == ([1, 2],)
