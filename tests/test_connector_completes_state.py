"""A KV connector completing a Mamba group's shallower hit (D-API-46): the
full-attention group still holds four blocks of a prefix, the Mamba group
only the state after the first; the connector loads the next block, Mamba
state included. As vLLM 0.33, the request adopts the full-attention hit and
every Mamba hit block falls below the loaded state (skipped, never touched).

Full attention + Mamba ``align``, both block 16, hash block 16, 200 blocks;
a 64-token prefix filled one block per step (the Mamba state cached at each
boundary), then a 96-token replay of it."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.mamba_spec import MambaSpec

N = 0
B = 16


def manager_of(impl: ModuleType, num_blocks: int = 200) -> Any:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(B, 1, 8, "float16")),
              KVCacheGroupSpec(("mamba",), MambaSpec(B, shapes=((2,),), dtypes=("float16",),
                                                     mamba_cache_mode="align")))
    return impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 8192, hash_block_size=B)


def diverged(impl: ModuleType, num_blocks: int = 200) -> tuple[Any, Any]:
    """The manager after the fill, its Mamba states past the first evicted,
    and the replay request."""
    manager = manager_of(impl, num_blocks)
    fill = manager.make_request("fill", [0] * 4 * B)
    for _ in range(4):
        manager.new_step_starts()
        assert manager.allocate_slots(fill, B) is not None
        fill.num_computed_tokens += B
    # Full attention 1, 3, 5, 7; the Mamba states 2, 4, 6, 8, one per boundary
    # (2 and 4 already released into the cache, as the state moved on).
    assert manager.get_block_ids("fill") == ([1, 3, 5, 7], [N, N, 6, 8])
    manager.free(fill)
    manager.evict_blocks({4, 6, 8})
    manager.new_step_starts()
    replay = manager.make_request("replay", [0] * 6 * B)
    hit, lengths = manager.get_computed_blocks_per_group(replay)
    assert lengths == (4 * B, 1 * B)
    assert hit.get_block_ids() == ([1, 3, 5, 7], [2])
    return manager, replay


def test_external_tokens_complete_a_shallower_mamba_hit(impl: ModuleType) -> None:
    manager, replay = diverged(impl)
    hit, _ = manager.get_computed_blocks_per_group(replay)
    free_before = manager.block_pool.get_num_free_blocks()
    new = manager.allocate_slots(replay, B, 4 * B, hit, 0, B)
    assert new is not None
    # Full attention adopts 1, 3, 5, 7, loads into 9 and computes into 11;
    # the Mamba hit block 2 is skipped (untouched), the state after 80 tokens
    # is loaded into 10 and the next one computed into 12.
    assert manager.get_block_ids("replay") == ([1, 3, 5, 7, 9, 11], [N, N, N, N, 10, 12])
    assert manager.block_pool.get_num_free_blocks() == free_before - 8
    manager.check_invariants()


def test_without_external_tokens_the_shallower_hit_is_refused(impl: ModuleType) -> None:
    """No connector load: the hit would resume from a Mamba state after 64
    tokens that no block holds; refused, nothing changes."""
    manager, replay = diverged(impl)
    hit, _ = manager.get_computed_blocks_per_group(replay)
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError, match="does not match the 1 computed blocks of group 1"):
        manager.allocate_slots(replay, B, 4 * B, hit, 0, 0)
    assert manager.snapshot() == before


def test_full_attention_may_not_hit_shallower(impl: ModuleType) -> None:
    """Only a Mamba group's state comes from the connector: full attention
    handing fewer blocks than its hit is refused even with a load after it."""
    manager, replay = diverged(impl)
    hit, _ = manager.get_computed_blocks_per_group(replay)
    short = manager.get_computed_blocks_per_group(manager.make_request("short", [0] * 2 * B))[0]
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError, match="does not match the 1 computed blocks of group 0"):
        manager.allocate_slots(replay, B, 2 * B, short, 0, B)
    assert manager.snapshot() == before
    assert hit.get_block_ids()[0] == [1, 3, 5, 7]


def test_too_few_free_blocks_answer_none(impl: ModuleType) -> None:
    """The demand counts the Mamba group's loaded state block: with 7 free
    blocks (the replay takes 4 cached full-attention blocks and 4 fresh ones)
    the call answers ``None`` and changes nothing. vLLM 0.33 leaves that
    block out of its count and raises ``ValueError: Cannot get 1 free blocks
    from the pool`` halfway through the allocation."""
    manager, replay = diverged(impl, num_blocks=10)
    hog = manager.make_request("hog", [1] * B)
    assert manager.allocate_slots(hog, B) is not None
    assert manager.get_block_ids("hog") == ([9], [2])
    assert manager.block_pool.get_num_free_blocks() == 7
    # The hog took the never-used block 9 and evicted the Mamba state 2:
    # the Mamba group now hits nothing, full attention still 4 blocks.
    hit, lengths = manager.get_computed_blocks_per_group(replay)
    assert (hit.get_block_ids(), lengths) == (([1, 3, 5, 7], []), (4 * B, 0))
    before = manager.snapshot()
    assert manager.allocate_slots(replay, B, 4 * B, hit, 0, B) is None
    assert manager.snapshot() == before
    manager.check_invariants()
