"""Edges of the feature modules that only a precise scenario reaches.

Each test pins one rule of a feature module (``reference/features/``) at the
point where a near-miss of it would still pass the scenario and lockstep
suites: the mutation run over those modules (``make mutation-features``,
tools/mutation_triage.md) found them. Every test runs on both
implementations.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest

from pagedkv.optimized.host_tier.hisparse import HostTierManager as OptimizedTier
from pagedkv.reference.features.hisparse import HostTierManager as ReferenceTier
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.attention_variants import CircularBufferSpec
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hisparse import HostTierConfig
from pagedkv.spec.mamba_spec import MambaSpec
from tests.faults import LineFuse
from tests.implementations import IMPLEMENTATIONS
from tests.scenario_kit import build_manager, full, window
from tests.test_dcp_partial_hits import dcp_hybrid

Tier = ReferenceTier | OptimizedTier


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    module: ModuleType = IMPLEMENTATIONS[request.param]
    return module


def _sub_block_hybrid(impl: ModuleType, num_blocks: int) -> Any:
    """Full attention (2 tokens a block) beside a Mamba ``align`` group (4),
    hashed every 2 tokens, with sub-block hits on."""
    specs = (FullAttentionSpec(2, 1, 1, "float32"),
             MambaSpec(4, shapes=((1,),), dtypes=("float32",), mamba_cache_mode="align"))
    groups = tuple(KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs))
    manager = impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 1024, hash_block_size=2)
    manager.enable_partial_hash_hits()
    return manager


@pytest.mark.parametrize(("num_blocks", "admitted"), [(6, False), (7, True)])
def test_sub_block_hit_counts_the_copy_destination_at_the_free_block_edge(
        impl: ModuleType, num_blocks: int, admitted: bool) -> None:
    """MPART-2: a new request's hit ending inside a Mamba block demands one
    block more, the copy's destination. The sibling's hit (6 tokens) touches
    the producer's four cached blocks; it then needs a full-attention block
    and the copy: 2 blocks. With 6 blocks (1 left after the touch) it is
    refused and nothing changes; with 7 it is admitted. Counting one block
    too few takes the refused case into the allocation, which then runs out
    of blocks half-way."""
    manager = _sub_block_hybrid(impl, num_blocks)
    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    manager.free(producer)
    manager.new_step_starts()
    sibling = manager.make_request("1", [0, 0, 1, 1, 2, 2, 3, 3])
    hit_blocks, hit = manager.get_computed_blocks(sibling)
    assert hit == 6
    assert manager.block_pool.get_num_free_blocks() == num_blocks - 1
    before = manager.snapshot()
    new = manager.allocate_slots(sibling, 2, hit, hit_blocks)
    manager.check_invariants()
    if admitted:
        assert new is not None
        assert [len(group) for group in new.get_block_ids()] == [1, 1]   # the FA block and the copy
        copies, retained = manager.take_kv_cache_block_copies()
        assert len(copies) == 1 and len(retained) == 2
    else:
        assert new is None
        assert manager.snapshot() == before


def _events_manager(impl: ModuleType) -> Any:
    spec = FullAttentionSpec(2, 1, 1, "float32")
    config = KVCacheConfig(12, (), (KVCacheGroupSpec(("layer.0",), spec),))
    return impl.KVCacheManager(config, 64, enable_kv_cache_events=True)


def _admit_and_fault(impl: ModuleType, fire_at: int) -> tuple[Any, bool]:
    """Admit request ``a`` (its blocks stored: events pending), then admit
    ``b`` with a fault armed at its ``fire_at``-th line event. Returns the
    manager and whether the fault fired."""
    manager = _events_manager(impl)
    first = manager.make_request("a", [1, 2, 3, 4, 5, 6, 7])
    assert manager.allocate_slots(first, 7) is not None
    second = manager.make_request("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    fuse = LineFuse(fire_at, KeyboardInterrupt)
    fired = False
    sys.settrace(fuse.global_trace)
    try:
        hit_blocks, hit = manager.get_computed_blocks(second)
        manager.allocate_slots(second, second.num_tokens - hit, hit, hit_blocks)
    except KeyboardInterrupt:
        fired = True
    finally:
        sys.settrace(None)
    return manager, fired


def test_recovery_keeps_the_events_pending_before_the_fault(impl: ModuleType) -> None:
    """Recovery after an interrupted change rebuilds the pool from the
    request lists, but events already emitted stay pending with events on
    (spec/operations.md, "Exception safety"): the engine still takes the
    ``BlockStored`` of ``a``'s blocks, stored before the fault. Tried at
    every fourth line event of ``b``'s lookup and admission."""
    reference_manager, _ = _admit_and_fault(impl, 0)
    stored_before = [event for event in reference_manager.take_events()
                     if type(event).__name__ == "BlockStored"]
    assert stored_before, "the first admission stores its full blocks"
    first_hashes = stored_before[0].block_hashes
    fired_once = False
    for fire_at in range(1, 400, 4):
        manager, fired = _admit_and_fault(impl, fire_at)
        if not fired:
            break
        fired_once = True
        manager.check_invariants()
        taken = manager.take_events()
        assert taken, f"line event {fire_at}: the pending events were dropped"
        assert type(taken[0]).__name__ == "BlockStored" and taken[0].block_hashes == first_hashes, (
            f"line event {fire_at}: {taken[0]!r}")
    assert fired_once


@pytest.fixture(params=[ReferenceTier, OptimizedTier], ids=["reference", "optimized"])
def host_tier(request: pytest.FixtureRequest) -> Tier:
    tier: Tier = request.param(HostTierConfig(block_size=4, host_num_blocks=16, device_num_blocks=10,
                                              hot_blocks_per_request=1, max_model_len=64))
    return tier


def test_a_reused_page_the_worker_never_saw_is_reported_once(host_tier: Tier) -> None:
    """A released page whose block the pool hands out turns host-only; it is
    *stale* (reported again) only if the worker was told of it before, i.e.
    below ``synced``. Page 2 here is reused exactly at ``synced`` = 2: the
    worker never saw it, so the next update lists it once, with the new
    pages, not also as a stale page."""
    tier = host_tier
    assert tier.allocate("a", 8) is not None
    assert tier.take_residency_updates(["a"])["a"].pages == (0, 1)  # synced = 2
    assert tier.allocate("a", 20) is not None  # pages 2..4, unseen
    tier.complete([transfer.transfer_id for transfer in tier.plan_writebacks("a", 20)])
    tier.require_hot("a")
    assert tier.allocate("a", 20) is not None
    tier.update_residency("a")  # pages 0..2 released, page 2 first; 3 and 4 are the active tail
    assert tier.residency("a").unpinned == frozenset({0, 1, 2})
    never_used = tier.num_free_device_blocks() - 3
    assert tier.allocate("b", 4 * (never_used + 1)) is not None  # reuses page 2's block
    assert tier.residency("a").resident_row[2] == 0
    update = tier.take_residency_updates(["a"])["a"]
    assert update.pages == (2, 3, 4)
    assert update.block_ids[0] == 0


def test_a_reused_block_leaves_the_other_holders_of_its_prompt_tail_serving(impl: ModuleType) -> None:
    """FPART-2 / D-MAMBA-22 under DCP (hash 2, full-attention block 8): two
    requests with the same 16-token prompt compute it side by side, so two
    blocks (``x1``, ``x2``) carry column 1's full key and the prompt tail 14
    as their extra entry. Once both are freed, another prompt reuses ``x1``
    at its own column 1 and gives it another tail. ``x2`` still holds the
    old tail: a resend of the first prompt hits 14 tokens through it."""
    manager = dcp_hybrid(impl, hash_block_size=2, full=8, mamba=2, dcp=4, num_blocks=10)
    owners = [manager.make_request(name, list(range(16))) for name in ("o1", "o2")]
    for owner in owners:  # no lookup: each computes its own blocks
        assert manager.allocate_slots(owner, 14) is not None
        owner.num_computed_tokens = 14
    manager.new_step_starts()
    for owner in owners:
        assert manager.allocate_slots(owner, 2) is not None
        owner.num_computed_tokens = 16
    x1, x2 = manager.get_block_ids("o1")[0][1], manager.get_block_ids("o2")[0][1]
    column_0 = manager.get_block_ids("o2")[0][0]
    for owner in owners:
        manager.free(owner)
    manager.new_step_starts()
    other = manager.make_request("other", list(range(100, 116)))
    assert manager.allocate_slots(other, 14) is not None
    other.num_computed_tokens = 14
    manager.new_step_starts()
    assert manager.allocate_slots(other, 2) is not None
    assert manager.get_block_ids("other")[0][1] == x1  # x1 reused, under another tail
    manager.free(other)
    manager.new_step_starts()
    hit_blocks, hit = manager.get_computed_blocks(manager.make_request("resend", list(range(16))))
    assert hit == 14
    assert list(hit_blocks.get_block_ids()[0]) == [column_0, x2]
    manager.check_invariants()


def test_a_sub_block_hit_off_a_hash_boundary_is_refused(impl: ModuleType) -> None:
    """MPART-1 (check 1f): with sub-block hits a hit may end inside a block,
    but only on a hash boundary. Handed the blocks of a real 14-token hit
    (hash 2: two full-attention blocks of 8, four Mamba columns of 4) with
    13 computed tokens, whose block counts match, ``allocate_slots`` refuses
    it and changes nothing."""
    manager = dcp_hybrid(impl, hash_block_size=2, full=8, mamba=4, dcp=4)
    owner = manager.make_request("owner", list(range(16)))
    assert manager.allocate_slots(owner, 14) is not None
    owner.num_computed_tokens = 14
    manager.new_step_starts()
    assert manager.allocate_slots(owner, 2) is not None
    manager.free(owner)
    manager.new_step_starts()
    resend = manager.make_request("resend", list(range(16)))
    hit_blocks, hit = manager.get_computed_blocks(resend)
    assert hit == 14 and [len(group) for group in hit_blocks.get_block_ids()] == [2, 4]
    before = manager.snapshot()
    with pytest.raises(InvalidArgumentError, match="num_new_computed_tokens"):
        manager.allocate_slots(resend, 3, 13, hit_blocks)
    assert manager.snapshot() == before
    assert manager.allocate_slots(resend, 2, hit, hit_blocks) is not None  # the real hit is taken


def test_per_group_hits_are_zero_where_nothing_is_cached(impl: ModuleType) -> None:
    """``get_computed_blocks_per_group`` (what a KV connector reads) reports
    0 tokens for a group that serves no hit: with one-token blocks (the hit
    unit is 1) when the first token is not cached, and for a ring, which is
    outside prefix caching (PFX-1), however long the full-attention hit."""
    one_group = (KVCacheGroupSpec(("full",), FullAttentionSpec(1, 1, 8, "float16")),)
    manager = impl.KVCacheManager(KVCacheConfig(40, (), one_group), 64)
    first = manager.make_request("a", [1, 2, 3])
    assert manager.allocate_slots(first, 3) is not None
    manager.free(first)
    hit, lengths = manager.get_computed_blocks_per_group(manager.make_request("b", [7, 8, 9, 10]))
    assert lengths == (0,) and hit.get_block_ids() == ([],)
    assert manager.get_computed_blocks_per_group(manager.make_request("c", [1, 2, 3, 4]))[1] == (3,)

    with_ring = (KVCacheGroupSpec(("full",), FullAttentionSpec(4, 1, 8, "float16")),
                 KVCacheGroupSpec(("ring",), CircularBufferSpec(4, 1, 8, "float16")))
    manager = impl.KVCacheManager(KVCacheConfig(20, (), with_ring), 64)
    first = manager.make_request("a", list(range(13)))
    assert manager.allocate_slots(first, 13) is not None
    manager.free(first)
    hit, lengths = manager.get_computed_blocks_per_group(manager.make_request("b", list(range(13))))
    assert lengths == (12, 0) and len(hit.get_block_ids()[0]) == 3 and hit.get_block_ids()[1] == []


def test_a_pinned_junction_keeps_one_window_tail_without_eagle(impl: ModuleType) -> None:
    """D-SWA-11 under retention 0 (full attention + window 4, block 4): B
    shares 16 tokens with A and pins the junction 16. Its window group keeps
    the tail of the replay position (block 6) and the junction's tail
    (block 3), and nothing else: the extra block below the junction is kept
    only with EAGLE, whose peek reads past the junction."""
    manager = build_manager(impl, (full(), window()), num_blocks=60, max_model_len=128, retention_interval=0)
    shared = [7] * 16
    assert manager.allocate_slots(manager.make_request("A", shared + list(range(100, 116))), 32) is not None
    second = manager.make_request("B", shared + list(range(200, 216)))
    hit, num_hit = manager.get_computed_blocks(second)
    second.shared_prefix_boundary = manager.shared_prefix_boundary(second, num_hit)
    assert second.shared_prefix_boundary == 16
    assert manager.allocate_slots(second, 32 - num_hit, num_hit, hit) is not None
    hashes = manager.snapshot().pool.block_hashes
    window_blocks = manager.get_block_ids("B")[1]
    assert [index for index, block in enumerate(window_blocks) if block and hashes[block] is not None] == [3, 6]
