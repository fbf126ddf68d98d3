"""Rules that sampled mutants showed no test pinned down (tools/mutation_triage.md).

Each test states the exact outcome the spec gives, for both implementations,
so a mutant of either one fails it (a lockstep comparison alone cannot see a
change both implementations would have to make together, and sees no
difference at all on a path only one of them has).
"""

from __future__ import annotations

from types import ModuleType

import pytest

from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from pagedkv.spec.mamba_spec import MambaSpec
from tests.implementations import IMPLEMENTATIONS

IMPLS = list(IMPLEMENTATIONS.values())
IDS = list(IMPLEMENTATIONS)


def _full_config(num_blocks: int, block_size: int = 4, groups: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size, 1, 8, "float16")
    return KVCacheConfig(num_blocks, (), tuple(KVCacheGroupSpec((f"l{g}",), spec) for g in range(groups)))


def _computed(impl: ModuleType, manager: object, request_id: str, tokens: list[int]) -> object:
    """A request allocated and computed in one step."""
    request = manager.make_request(request_id, tokens)  # type: ignore[attr-defined]
    hit, num_hit = manager.get_computed_blocks(request)  # type: ignore[attr-defined]
    assert manager.allocate_slots(request, len(tokens) - num_hit, num_hit, hit) is not None  # type: ignore[attr-defined]
    request.num_computed_tokens = len(tokens)
    return request


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_blocks_add_concatenates_per_group(impl: ModuleType) -> None:
    manager = impl.KVCacheManager(_full_config(16, groups=2), 64, enable_caching=False)
    a = manager.make_request("a", [1] * 8)
    b = manager.make_request("b", [2] * 4)
    first = manager.allocate_slots(a, 8)
    second = manager.allocate_slots(b, 4)
    total = first + second
    assert total.get_block_ids() == tuple(x + y for x, y in zip(first.get_block_ids(), second.get_block_ids()))
    assert total.new_empty().get_block_ids() == ([], [])
    with pytest.raises(InvalidArgumentError):
        total.get_unhashed_block_ids()


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_unhashed_block_ids_are_those_not_cached_now(impl: ModuleType) -> None:
    manager = impl.KVCacheManager(_full_config(16), 64)
    request = manager.make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    blocks = manager.allocate_slots(request, 10)
    ids = blocks.get_block_ids()[0]
    # Two full blocks were cached by the allocation, the partial third was not.
    assert blocks.get_unhashed_block_ids() == ids[2:]
    manager.evict_blocks([ids[0]])
    assert blocks.get_unhashed_block_ids() == [ids[0], ids[2]]


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
@pytest.mark.parametrize(("num_blocks", "admitted"), [(6, True), (5, False)])
def test_full_sequence_demand_counts_free_hit_blocks(impl: ModuleType, num_blocks: int, admitted: bool) -> None:
    """A 20-token request hitting 2 cached free blocks, admitted one token at
    a time but with the whole sequence required to fit: 5 blocks in all, of
    which the 2 hit blocks leave the free queue when touched. 5 free: yes;
    4 free: no (the plain demand, 3, would fit)."""
    manager = impl.KVCacheManager(_full_config(num_blocks), 32)
    old = _computed(impl, manager, "old", list(range(8)))
    manager.free(old)
    request = manager.make_request("new", list(range(8)) + [50 + i for i in range(12)])
    hit, num_hit = manager.get_computed_blocks(request)
    assert num_hit == 8
    out = manager.allocate_slots(request, 1, num_hit, hit, full_sequence_must_fit=True)
    assert (out is not None) is admitted
    if not admitted:
        assert manager.allocate_slots(request, 1, num_hit, hit) is not None   # without the rule it fits


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_mamba_none_mode_never_hits(impl: ModuleType) -> None:
    specs = (FullAttentionSpec(4, 1, 8, "float16"),
             MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="none"))
    config = KVCacheConfig(32, (), tuple(KVCacheGroupSpec((f"l{g}",), s) for g, s in enumerate(specs)))
    manager = impl.KVCacheManager(config, 64)
    old = _computed(impl, manager, "old", list(range(12)))
    manager.free(old)
    hit, num_hit = manager.get_computed_blocks(manager.make_request("new", list(range(12)) + [99]))
    assert num_hit == 0
    assert hit.get_block_ids() == ([], [])


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_sliding_window_hit_keeps_only_the_window(impl: ModuleType) -> None:
    """Window 5, block size 4: a 12-token hit of a 13-token request needs
    positions 8..11 only, so the hit is [null, null, block] for the window
    group (and the full group's three blocks)."""
    specs = (FullAttentionSpec(4, 1, 8, "float16"), SlidingWindowSpec(4, 1, 8, "float16", sliding_window=5))
    config = KVCacheConfig(32, (), tuple(KVCacheGroupSpec((f"l{g}",), s) for g, s in enumerate(specs)))
    manager = impl.KVCacheManager(config, 64)
    old = _computed(impl, manager, "old", list(range(13)))
    manager.free(old)
    hit, num_hit = manager.get_computed_blocks(manager.make_request("new", list(range(12)) + [99]))
    assert num_hit == 12
    full, window = hit.get_block_ids()
    assert len(full) == 3 and all(full)
    assert window[:1] == [0] and len(window) == 3 and window[2] != 0


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
@pytest.mark.parametrize(("use_eagle", "expected"), [(False, 4), (True, 0)])
def test_eagle_drops_a_one_block_hit(impl: ModuleType, use_eagle: bool, expected: int) -> None:
    manager = impl.KVCacheManager(_full_config(16), 64, use_eagle=use_eagle)
    old = _computed(impl, manager, "old", [0, 1, 2, 3, 4])
    manager.free(old)
    _, num_hit = manager.get_computed_blocks(manager.make_request("new", [0, 1, 2, 3, 9]))
    assert num_hit == expected


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_mamba_align_releases_the_previous_state_one_step_later(impl: ModuleType) -> None:
    """Align mode, block size 4: the state block of the block just left is
    kept as the copy source for one step, then released (MAMBA-1)."""
    specs = (FullAttentionSpec(4, 1, 8, "float16"),
             MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align"))
    config = KVCacheConfig(40, (), tuple(KVCacheGroupSpec((f"l{g}",), s) for g, s in enumerate(specs)))
    manager = impl.KVCacheManager(config, 64)
    request = manager.make_request("a", list(range(6)))
    manager.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    lists = [manager.get_block_ids("a")[1]]
    for _ in range(8):
        request.append_output_token_ids(1)
        manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        lists.append(manager.get_block_ids("a")[1])
    shapes = [tuple(bool(block) for block in blocks) for blocks in lists]
    assert shapes == [(False, True)] * 3 + [(False, True, True)] + [(False, False, True)] * 3 + [
        (False, False, True, True), (False, False, False, True)]


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_blocks_compare_by_ids_and_never_equal_other_things(impl: ModuleType) -> None:
    manager = impl.KVCacheManager(_full_config(16), 64)
    blocks = manager.allocate_slots(manager.make_request("a", [1] * 6), 6)
    assert blocks.get_block_ids() == manager.get_blocks("a").get_block_ids()
    assert (blocks == 5) is False
    assert (blocks != "blocks") is True


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_pool_free_with_a_block_named_twice_releases_it_where_its_count_reaches_zero(impl: ModuleType) -> None:
    """D-API-35 (vLLM 0.33's one pass): unhashed blocks go to the front in
    release order, and ``a`` is released at its second occurrence."""
    pool = impl.BlockPool(8, False)
    a, b, _ = pool.get_new_blocks(3)
    pool.touch([a])                    # a: ref 2, b: ref 1
    pool.free_blocks([a, b, a])
    ids = [getattr(block, "block_id", block) for block in (b, a)]
    assert list(pool.snapshot().free_queue[:2]) == ids


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_pool_free_named_twice_hashed_blocks_join_the_back_where_their_count_reaches_zero(
        impl: ModuleType) -> None:
    """The same rule for cached blocks, which join the back of the queue;
    a block whose count stays above 0 is not released at all."""
    manager = impl.KVCacheManager(_full_config(8), 64)
    request = manager.make_request("r", list(range(12)))
    assert manager.allocate_slots(request, 12) is not None
    pool = manager.block_pool
    x_block, y_block, z_block = manager.get_blocks("r").blocks[0]
    x, y, z = (getattr(block, "block_id", block) for block in (x_block, y_block, z_block))
    pool.touch([x_block, x_block, y_block])   # x: ref 3, y: ref 2, z: ref 1
    pool.free_blocks([x_block, y_block, z_block, x_block, y_block])
    queue = list(pool.snapshot().free_queue)
    assert queue[-2:] == [z, y]               # x keeps one reference
    assert x not in queue


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_mamba_align_step_needing_no_block_fits_a_full_pool(impl: ModuleType) -> None:
    """Align mode: a decode step inside the block the state already covers
    demands nothing, so it succeeds with no free block at all."""
    specs = (FullAttentionSpec(4, 1, 8, "float16"),
             MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align"))
    config = KVCacheConfig(4, (), tuple(KVCacheGroupSpec((f"l{g}",), s) for g, s in enumerate(specs)))
    manager = impl.KVCacheManager(config, 64)
    request = manager.make_request("a", list(range(6)))
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    assert manager.block_pool.get_num_free_blocks() == 0
    request.append_output_token_ids(1)
    out = manager.allocate_slots(request, 1)
    assert out is not None and out.get_block_ids() == ([], [])



def test_optimized_blocks_length_is_group_zeros() -> None:
    """``len(KVCacheBlocks)`` (optimized only): the blocks of group 0, 0 without groups."""
    optimized = IMPLEMENTATIONS["optimized"]
    manager = optimized.KVCacheManager(_full_config(16, groups=2), 64, enable_caching=False)
    blocks = manager.allocate_slots(manager.make_request("a", [1] * 6), 6)
    assert len(blocks) == 2
    assert len(optimized.KVCacheBlocks((), [])) == 0


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_hit_with_groups_swapped_is_stale(impl: ModuleType) -> None:
    """Two full-attention groups: each block of a real hit carries the right
    hash but, with the groups' lists swapped, the other group's id (1i).
    The optimized whole-list check must compare group ids too."""
    manager = impl.KVCacheManager(_full_config(32, groups=2), 64)
    old = manager.make_request("old", list(range(9)))
    assert manager.allocate_slots(old, 9) is not None
    old.num_computed_tokens = 9
    manager.free(old)
    new = manager.make_request("new", list(range(9)))
    hit, num_hit = manager.get_computed_blocks(new)
    assert num_hit == 8
    swapped = type(hit)(tuple(reversed(hit.blocks)), *([] if impl is IMPLEMENTATIONS["reference"]
                                                       else [manager.block_pool.block_hashes]))
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError, match="stale"):
        manager.allocate_slots(new, 1, num_hit, swapped)
    assert manager.snapshot() == before
    assert manager.allocate_slots(new, 1, num_hit, hit) is not None
