"""vLLM 0.33's HiSparse scenarios, restated on pagedkv's host tier with concrete block ids.

Each test follows one of vLLM's own tests (named in its docstring) through the
host-tier operations an adapter would call, on both implementations: the
shared device pool (``take_shared``, D-HOST-18), head-first reuse of pages
released on completion (D-HOST-19), residency updates, per-worker counts.
Pools: 16 host and 16 device blocks (block 0 null), block size 4, hot region 2.
"""

from __future__ import annotations

import pytest

from pagedkv.optimized.host_tier.hisparse import HostTierManager as OptimizedTier
from pagedkv.reference.features.hisparse import HostTierManager as ReferenceTier
from pagedkv.spec.hisparse import HostTierConfig, PageTransfer, ResidencyUpdate

Tier = ReferenceTier | OptimizedTier
B = 4


@pytest.fixture(params=[ReferenceTier, OptimizedTier], ids=["reference", "optimized"])
def tier(request: pytest.FixtureRequest) -> Tier:
    built: Tier = request.param(HostTierConfig(
        block_size=B, host_num_blocks=16, device_num_blocks=16, hot_blocks_per_request=2,
        max_model_len=64))
    return built


def _check(tier: Tier) -> None:
    if isinstance(tier, ReferenceTier):
        tier.check_invariants()


def _write_back_everything(tier: Tier, request_id: str, num_tokens: int) -> None:
    """Plan the request's write-backs and let one worker run them all."""
    tier.advance(request_id, num_tokens)
    counts = {t.transfer_id: 1 for t in tier.take_transfers()}
    tier.report_transfers(counts, counts)


def _with_hot_region(tier: Tier, request_id: str, num_tokens: int) -> None:
    assert tier.allocate(request_id, num_tokens) is not None
    tier.require_hot(request_id)
    assert tier.allocate(request_id, num_tokens) is not None


def test_a_reused_page_is_the_only_one_resent(tier: Tier) -> None:
    """test_hisparse_residency_update_sends_only_changed_pages."""
    _with_hot_region(tier, "r", 6 * B)  # device 1..6, hot 7 8
    assert tier.residency("r").hot == (7, 8)
    tier.take_residency_updates(["r"])
    never_used = tier.num_free_device_blocks()
    assert never_used == 7  # blocks 9..15
    _write_back_everything(tier, "r", 6 * B)
    # Pages 0..3 were released as they became clean, head first; 4, 5 are the tail.
    assert tier.snapshot().device_free == (9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 4)
    assert tier.take_shared(never_used + 1) == (9, 10, 11, 12, 13, 14, 15, 1)
    assert tier.take_residency_updates(["r"]) == {"r": ResidencyUpdate((0,), (0,))}
    _check(tier)


def test_losing_pages_to_another_group_ends_full_residency(tier: Tier) -> None:
    """test_hisparse_reports_when_context_is_fully_resident."""
    assert tier.allocate("r", 4 * B) is not None
    assert tier.fully_resident("r")
    tier.require_hot("r")
    assert tier.allocate("r", 4 * B) is not None  # hot 5 6
    _write_back_everything(tier, "r", 4 * B)
    tier.take_residency_updates(["r"])
    taken = tier.take_shared(tier.num_free_device_blocks())  # the indexer fills the pool
    assert taken == (7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2)
    assert not tier.fully_resident("r")
    assert tier.residency("r").resident_row == (0, 0, 3, 4)
    assert tier.residency("r").hot_required
    assert tier.take_residency_updates(["r"]) == {"r": ResidencyUpdate((0, 1), (0, 0))}
    tier.free_shared(taken[::-1])
    assert tier.num_free_device_blocks() == 11
    _check(tier)


def test_a_readmitted_request_resends_every_page(tier: Tier) -> None:
    """test_hisparse_readmitted_request_resends_its_full_residency."""
    assert tier.allocate("r", 2 * B) is not None
    assert tier.take_residency_updates(["r"]) == {"r": ResidencyUpdate((0, 1), (1, 2))}
    tier.free("r")
    assert tier.allocate("r", 2 * B) is not None  # device 3 4: 1 and 2 went to the back
    assert tier.take_residency_updates(["r"]) == {"r": ResidencyUpdate((0, 1), (3, 4))}


def test_an_aborted_imports_tail_restore_keeps_both_blocks(tier: Tier) -> None:
    """test_hisparse_aborted_tail_restore_retains_both_endpoints."""
    allocation = tier.allocate("r", B + 1, num_external_tokens=B + 1)
    assert allocation is not None
    assert allocation.host_blocks == (1, 2) and allocation.resident_blocks == (1,)
    assert allocation.hot_blocks == (2, 3)
    assert tier.residency("r").resident_row == (0, 1)  # page 0 stays host-only
    restore = tier.finish_import("r")
    assert restore == PageTransfer(0, "r", 1, 2, 1, "restore")
    assert tier.take_transfers() == [restore]
    tier.free("r")
    held = tier.snapshot()
    assert 2 not in held.host_free and 1 not in held.device_free
    assert tier.report_transfers({0: 2}, {0: 1}) == []  # one of two workers
    assert tier.snapshot().worker_counts == ((0, 2, 1),)
    assert tier.snapshot().host_free == held.host_free
    assert tier.snapshot().device_free == held.device_free
    assert tier.report_transfers({}, {0: 1}) == [0]
    assert tier.num_free_host_blocks() == 15 and tier.num_free_device_blocks() == 15
    _check(tier)


@pytest.mark.parametrize("kind", ["reference", "optimized"])
def test_the_main_pool_releases_a_still_read_block_to_the_back(kind: str) -> None:
    """BlockPool.release_to_back (D-HOST-20): an unhashed block normally goes
    to the front of the free queue when freed; one its holder still reads
    goes to the back, so the pool reuses it last."""
    from pagedkv.optimized.pool.block_pool import BlockPool as OptimizedPool
    from pagedkv.reference.block_pool import BlockPool as ReferencePool
    from pagedkv.reference.features.hisparse import release_to_back
    from pagedkv.spec.errors import InvariantViolation

    def free_ids(pool: ReferencePool | OptimizedPool) -> list[int]:
        if isinstance(pool, ReferencePool):
            return [block.block_id for block in pool.free_queue]
        return pool.free_queue_ids()

    if kind == "reference":
        ref_pool = ReferencePool(6, enable_caching=True)
        a, b, c = ref_pool.get_new_blocks(3)
        ref_pool.free_blocks([a])
        release_to_back(ref_pool, [b])
        assert free_ids(ref_pool) == [1, 4, 5, 2]
        with pytest.raises(InvariantViolation):
            release_to_back(ref_pool, [c, c])
        assert c.ref_cnt == 1
        return
    pool = OptimizedPool(6, enable_caching=True)
    assert pool.get_new_blocks(3) == [1, 2, 3]
    pool.free_blocks([1])
    pool.release_to_back([2])
    assert free_ids(pool) == [1, 4, 5, 2]
    with pytest.raises(InvariantViolation):
        pool.release_to_back([3, 3])
    with pytest.raises(InvariantViolation):
        pool.release_to_back([0])
    assert pool.ref_count(3) == 1
