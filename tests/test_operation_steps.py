"""One test per operation step of spec/operations.md, on every implementation.

The steps of ``allocate_slots`` (ALLOC-1..9), the prefix lookup
(LOOKUP-1..6), ``free`` (FREE-1..6), taking free blocks and the eviction it
does (EVICT-1..5) and ``reset_prefix_cache`` (RESET-1..4) each have an ID;
each test below names the steps it holds to their sentence in the spec, so
``grep -rn ALLOC-5`` leads from the spec to the code and to its test.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.spec import InvariantViolation
from pagedkv.spec.errors import (
    InvalidArgumentError,
    InvalidTokenCountError,
    PoolExhaustedError,
    UnknownRequestError,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import AllBlocksCleared, BlockRemoved
from tests.implementations import IMPLEMENTATIONS
from tests.scenario_kit import build_manager, full, window

IMPLS = pytest.mark.parametrize("impl", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
PROMPT = list(range(1, 10))  # 9 tokens: two full blocks of 4 and one token


def _manager(impl: ModuleType, num_blocks: int = 10, **kwargs: Any) -> Any:
    return build_manager(impl, (full(),), num_blocks=num_blocks, max_model_len=64, **kwargs)


def _admit(manager: Any, request_id: str, prompt: list[int] = PROMPT) -> Any:
    """A new request: its hit taken, its prompt allocated and cached."""
    request = manager.make_request(request_id, prompt)
    hit, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(prompt) - num_hit, num_hit, hit) is not None
    request.num_computed_tokens = len(prompt)
    return request


def _ids(blocks: Any) -> list[int]:
    return [int(block) for block in blocks.get_block_ids()[0]]


# -- allocate_slots ----------------------------------------------------------------------

@IMPLS
def test_alloc_1_a_refused_argument_changes_nothing(impl: ModuleType) -> None:
    """ALLOC-1: validated before any change; the first failed check raises."""
    manager = _manager(impl)
    request = manager.make_request("a", PROMPT)
    before = manager.snapshot()
    with pytest.raises(InvalidTokenCountError):
        manager.allocate_slots(request, 0, num_lookahead_tokens=-1)  # 1a fails before 1b
    assert manager.snapshot() == before


@IMPLS
def test_alloc_2_lookahead_is_capped_at_max_model_len(impl: ModuleType) -> None:
    """ALLOC-2: need = min(main + lookahead, max_model_len)."""
    manager = build_manager(impl, (full(),), num_blocks=10, max_model_len=12)
    request = manager.make_request("a", PROMPT)
    blocks = manager.allocate_slots(request, len(PROMPT), num_lookahead_tokens=100)
    assert len(_ids(blocks)) == 3  # cdiv(12, 4), not cdiv(109, 4)


@IMPLS
def test_alloc_3_skipped_blocks_are_released_even_when_alloc_5_refuses(impl: ModuleType) -> None:
    """ALLOC-3: a window's dead blocks go back before the capacity gate."""
    manager = build_manager(impl, (window(size=4),), num_blocks=4, max_model_len=64)
    request = manager.make_request("a", list(range(1, 9)))
    assert manager.allocate_slots(request, 8) is not None
    request.num_computed_tokens = 8
    free_before = manager.block_pool.get_num_free_blocks()
    request.append_output_token_ids(list(range(20, 40)))
    assert manager.allocate_slots(request, 20) is None  # ALLOC-5 refuses
    assert manager.get_block_ids("a")[0][0] == 0  # block 0 left the window: null now
    assert manager.block_pool.get_num_free_blocks() == free_before + 1


@IMPLS
def test_alloc_4_a_state_cached_this_step_is_not_a_hit_until_the_next(impl: ModuleType) -> None:
    """ALLOC-4: the Mamba step rule, lifted by new_step_starts()."""
    mamba = MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="all")
    manager = build_manager(impl, (mamba,), num_blocks=20, max_model_len=64)
    _admit(manager, "a")
    request = manager.make_request("b", PROMPT)
    hit, num_hit = manager.get_computed_blocks(request)
    assert num_hit > 0
    before = manager.snapshot()
    assert manager.allocate_slots(request, len(PROMPT) - num_hit, num_hit, hit) is None
    assert manager.snapshot() == before
    manager.new_step_starts()
    assert manager.allocate_slots(request, len(PROMPT) - num_hit, num_hit, hit) is not None


@IMPLS
def test_alloc_5_reserved_and_watermark_blocks_stay_free(impl: ModuleType) -> None:
    """ALLOC-5: demand + reserved + watermark > free refuses; state as after ALLOC-3."""
    manager = _manager(impl, num_blocks=5)  # 4 usable, the prompt needs 3
    request = manager.make_request("a", PROMPT)
    before = manager.snapshot()
    assert manager.allocate_slots(request, len(PROMPT), reserved_blocks=1, watermark_blocks=1) is None
    assert manager.snapshot() == before
    assert manager.allocate_slots(request, len(PROMPT), reserved_blocks=1) is not None


@IMPLS
def test_alloc_6_a_free_cached_hit_leaves_the_free_queue(impl: ModuleType) -> None:
    """ALLOC-6: the hit is touched and heads the new request's list."""
    manager = _manager(impl)
    manager.free(_admit(manager, "a"))
    request = manager.make_request("b", PROMPT)
    hit, num_hit = manager.get_computed_blocks(request)
    hit_ids = _ids(hit)
    assert num_hit == 8 and all(block in manager.snapshot().pool.free_queue for block in hit_ids)
    manager.allocate_slots(request, 1, num_hit, hit)
    pool = manager.snapshot().pool
    assert not set(hit_ids) & set(pool.free_queue)
    assert [pool.ref_counts[block] for block in hit_ids] == [1, 1]
    assert list(manager.get_block_ids("b")[0][:2]) == hit_ids


@IMPLS
def test_alloc_7_and_evict_2_fresh_blocks_come_from_the_front_of_the_queue(impl: ModuleType) -> None:
    """ALLOC-7 appends EVICT-2's blocks: the free queue's first, in order."""
    manager = _manager(impl)
    front = list(manager.snapshot().pool.free_queue[:3])
    request = manager.make_request("a", PROMPT)
    assert _ids(manager.allocate_slots(request, len(PROMPT))) == front
    assert list(manager.get_block_ids("a")[0]) == front


@IMPLS
def test_alloc_8_caches_full_blocks_of_computed_tokens_only(impl: ModuleType) -> None:
    """ALLOC-8: full blocks of the tokens asked are cached; lookahead never,
    nor anything with delay_cache_blocks."""
    manager = _manager(impl)
    request = manager.make_request("a", PROMPT)
    blocks = _ids(manager.allocate_slots(request, len(PROMPT), num_lookahead_tokens=8))
    hashes = manager.snapshot().pool.block_hashes
    assert [hashes[block] is not None for block in blocks] == [True, True, False, False, False]
    delayed = manager.make_request("b", [50 + token for token in PROMPT])
    later = _ids(manager.allocate_slots(delayed, len(PROMPT), delay_cache_blocks=True))
    assert all(manager.snapshot().pool.block_hashes[block] is None for block in later)


@IMPLS
def test_alloc_9_returns_the_new_blocks_only(impl: ModuleType) -> None:
    """ALLOC-9: the blocks of ALLOC-7, not the hit's."""
    manager = _manager(impl)
    manager.free(_admit(manager, "a"))
    request = manager.make_request("b", PROMPT)
    hit, num_hit = manager.get_computed_blocks(request)
    new = _ids(manager.allocate_slots(request, 1, num_hit, hit))
    assert len(new) == 1 and new == list(manager.get_block_ids("b")[0][2:])


# -- the prefix lookup --------------------------------------------------------------------

@IMPLS
def test_lookup_1_no_cache_reading_means_no_hit_and_no_stats(impl: ModuleType) -> None:
    """LOOKUP-1: caching off, or skip_reading_prefix_cache: (empty, 0), no lookup recorded."""
    off = _manager(impl, enable_caching=False)
    _admit(off, "a")
    assert off.get_computed_blocks(off.make_request("b", PROMPT))[1] == 0
    manager = _manager(impl, log_stats=True)
    _admit(manager, "a")
    manager.make_prefix_cache_stats()
    skipping = manager.make_request("b", PROMPT, skip_reading_prefix_cache=True)
    hit, num_hit = manager.get_computed_blocks(skipping)
    assert num_hit == 0 and not any(hit.get_block_ids())
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and stats.requests == 0


@IMPLS
def test_lookup_2_the_last_token_is_always_recomputed(impl: ModuleType) -> None:
    """LOOKUP-2: cap = num_tokens - 1, so a fully cached 8-token prompt hits 4."""
    manager = _manager(impl)
    _admit(manager, "a", PROMPT[:8])
    assert manager.get_computed_blocks(manager.make_request("b", PROMPT[:8]))[1] == 4


@IMPLS
def test_lookup_3_and_4_the_common_hit_is_aligned_and_each_group_hands_its_blocks(impl: ModuleType) -> None:
    """LOOKUP-3: the longest length every group serves, a multiple of A = lcm(2, 4);
    LOOKUP-4: L / b(g) blocks per group."""
    manager = build_manager(impl, (full(2), full(4)), num_blocks=40, max_model_len=64)
    prompt = list(range(1, 12))  # 11 tokens: the cap is 10, aligned down to 8
    _admit(manager, "a", prompt)
    hit, num_hit = manager.get_computed_blocks(manager.make_request("b", prompt))
    assert num_hit == 8
    assert [len(ids) for ids in hit.get_block_ids()] == [4, 2]


@IMPLS
def test_lookup_5_one_lookup_is_recorded_with_its_hit(impl: ModuleType) -> None:
    """LOOKUP-5: requests, queries (tokens asked) and hits (tokens found)."""
    manager = _manager(impl, log_stats=True)
    _admit(manager, "a")
    manager.make_prefix_cache_stats()
    manager.get_computed_blocks(manager.make_request("b", PROMPT))
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (1, 9, 8)


@IMPLS
def test_lookup_6_a_lookup_changes_nothing(impl: ModuleType) -> None:
    """LOOKUP-6: no ref count, hash, queue position or request moves."""
    manager = _manager(impl)
    manager.free(_admit(manager, "a"))
    before = manager.snapshot()
    manager.get_computed_blocks(manager.make_request("b", PROMPT))
    assert manager.snapshot() == before


# -- free ----------------------------------------------------------------------------------

@IMPLS
def test_free_1_an_unknown_request(impl: ModuleType) -> None:
    """FREE-1: UnknownRequestError, or nothing with missing_ok."""
    manager = _manager(impl)
    stranger = manager.make_request("x", PROMPT)
    with pytest.raises(UnknownRequestError):
        manager.free(stranger)
    before = manager.snapshot()
    manager.free(stranger, missing_ok=True)
    assert manager.snapshot() == before


@IMPLS
def test_free_2_4_5_tail_first_hashed_to_the_back_unhashed_to_the_front(impl: ModuleType) -> None:
    """FREE-2: the list is released tail first; FREE-4: counts drop; FREE-5:
    the unhashed block joins the front, the hashed ones the back in release order."""
    manager = _manager(impl)
    request = _admit(manager, "a")
    first, second, partial = manager.get_block_ids("a")[0]
    manager.free(request)
    queue = list(manager.snapshot().pool.free_queue)
    assert queue[0] == partial
    assert queue[-2:] == [second, first]
    assert all(manager.snapshot().pool.ref_counts[block] == 0 for block in (first, second, partial))


@IMPLS
def test_free_3_releasing_more_often_than_held_changes_nothing(impl: ModuleType) -> None:
    """FREE-3: every count is checked before any moves."""
    manager = _manager(impl)
    pool = manager.block_pool
    block = pool.get_new_blocks(1)[0]
    before = manager.snapshot()
    with pytest.raises(InvariantViolation, match="^POOL-3:"):
        pool.free_blocks([block, block])
    assert manager.snapshot() == before


@IMPLS
def test_free_6_the_request_is_forgotten(impl: ModuleType) -> None:
    """FREE-6: a freed request is unknown; its id may be admitted again."""
    manager = _manager(impl)
    manager.free(_admit(manager, "a"))
    with pytest.raises(UnknownRequestError):
        manager.get_blocks("a")
    _admit(manager, "a")


# -- taking free blocks: eviction ------------------------------------------------------------

@IMPLS
def test_evict_1_a_bad_count_changes_nothing(impl: ModuleType) -> None:
    """EVICT-1: n an int >= 0 and at most the free blocks, checked first."""
    manager = _manager(impl)
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError):
        manager.block_pool.get_new_blocks(-1)
    with pytest.raises(PoolExhaustedError):
        manager.block_pool.get_new_blocks(10)
    assert manager.snapshot() == before


@IMPLS
def test_evict_3_4_5_taking_a_cached_free_block_evicts_its_key(impl: ModuleType) -> None:
    """EVICT-3: its key leaves the cache; EVICT-4: hash None and one BlockRemoved;
    EVICT-5: ref count 1."""
    manager = _manager(impl, num_blocks=4, enable_kv_cache_events=True)  # 3 usable, the prompt takes all
    manager.free(_admit(manager, "a"))
    manager.take_events()
    queue = list(manager.snapshot().pool.free_queue)
    hashed = [block for block in queue if manager.snapshot().pool.block_hashes[block] is not None]
    manager.block_pool.get_new_blocks(len(queue))
    pool = manager.snapshot().pool
    assert not pool.cached and all(pool.block_hashes[block] is None for block in hashed)
    assert [pool.ref_counts[block] for block in queue] == [1, 1, 1]
    events = manager.take_events()
    assert len(events) == len(hashed) and all(isinstance(event, BlockRemoved) for event in events)


# -- reset_prefix_cache ---------------------------------------------------------------------

@IMPLS
def test_reset_1_refused_while_a_block_is_in_use(impl: ModuleType) -> None:
    """RESET-1: False, nothing changes."""
    manager = _manager(impl, enable_kv_cache_events=True)
    _admit(manager, "a")
    before = manager.snapshot()
    assert manager.reset_prefix_cache() is False
    assert manager.snapshot() == before


@IMPLS
def test_reset_2_3_4_drops_every_key_keeps_the_queue_and_announces_it(impl: ModuleType) -> None:
    """RESET-2: no key left, queue order kept; RESET-3: one AllBlocksCleared;
    RESET-4: the stats are marked reset."""
    manager = _manager(impl, enable_kv_cache_events=True, log_stats=True)
    manager.free(_admit(manager, "a"))
    manager.take_events()
    queue = manager.snapshot().pool.free_queue
    assert manager.reset_prefix_cache() is True
    pool = manager.snapshot().pool
    assert not pool.cached and all(key is None for key in pool.block_hashes)
    assert pool.free_queue == queue
    assert manager.take_events() == [AllBlocksCleared()]
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and stats.reset
