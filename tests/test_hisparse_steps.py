"""The host tier's per-step work with concrete block ids, on both implementations:
``advance`` (reprefillable tokens, the spill budget), ``take_transfers`` (the
outbox) and ``report_transfers`` (per-worker counts, D-HOST-12/13)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.optimized.host_tier.hisparse import HostTierManager as OptimizedTier
from pagedkv.reference.features.hisparse import HostTierManager as ReferenceTier
from pagedkv.spec.errors import InvalidArgumentError, UnknownRequestError
from pagedkv.spec.hisparse import HostTierConfig, PageTransfer
from pagedkv.spec.types import BlockHash

Tier = ReferenceTier | OptimizedTier
B = 4


@pytest.fixture(params=[ReferenceTier, OptimizedTier], ids=["reference", "optimized"])
def make(request: pytest.FixtureRequest) -> Callable[..., Tier]:
    def build(reprefill: int = 0, spill: int | None = None, hot: int = 2) -> Tier:
        tier: Tier = request.param(HostTierConfig(
            block_size=B, host_num_blocks=16, device_num_blocks=16, hot_blocks_per_request=hot,
            max_model_len=64, num_reprefillable_tokens=reprefill, max_spill_pages=spill))
        return tier
    return build


def _check(tier: Tier) -> None:
    if isinstance(tier, ReferenceTier):
        tier.check_invariants()


def _writeback(t: int, page: int, host: int, device: int) -> PageTransfer:
    return PageTransfer(t, "r", page, host, device, "writeback")


def test_advance_leaves_the_reprefillable_tokens_out(make: Callable[..., Tier]) -> None:
    tier = make(reprefill=3)
    allocation = tier.allocate("r", 2 * B)
    assert allocation is not None
    assert allocation.host_blocks == (1, 2) and allocation.resident_blocks == (1, 2)
    # 8 tokens computed, the last 3 prefilled again: only page 0 is final.
    assert tier.advance("r", 2 * B) == [_writeback(0, 0, 1, 1)]
    assert tier.residency("r").pending == {0}
    assert tier.take_transfers() == [_writeback(0, 0, 1, 1)]
    assert tier.take_transfers() == []  # the outbox emptied
    _check(tier)


def test_the_spill_budget_caps_what_the_outbox_holds(make: Callable[..., Tier]) -> None:
    tier = make(spill=2)
    assert tier.allocate("r", 4 * B) is not None
    assert tier.advance("r", 4 * B) == [_writeback(0, 0, 1, 1), _writeback(1, 1, 2, 2)]
    assert tier.advance("r", 4 * B) == []  # two transfers wait: the budget is spent
    assert [t.transfer_id for t in tier.take_transfers()] == [0, 1]
    assert tier.advance("r", 4 * B) == [_writeback(2, 2, 3, 3), _writeback(3, 3, 4, 4)]
    _check(tier)


def test_the_default_spill_budget_is_a_full_context(make: Callable[..., Tier]) -> None:
    tier = make()  # max_model_len 64 / block 4: 16 pages
    assert tier.config.spill_budget == 16
    assert tier.allocate("r", 60) is not None  # 15 pages: the whole host pool
    assert len(tier.advance("r", 60)) == 15


def test_a_transfer_completes_when_every_worker_reported_it(make: Callable[..., Tier]) -> None:
    tier = make()
    assert tier.allocate("r", 3 * B) is not None
    tier.advance("r", 3 * B)
    assert [t.transfer_id for t in tier.take_transfers()] == [0, 1, 2]
    # Two tensor-parallel workers enqueued transfers 0 and 1; one finished both.
    assert tier.report_transfers({0: 2, 1: 2}, {0: 1, 1: 1}) == []
    assert tier.residency("r").pending == {0, 1, 2} and tier.residency("r").clean == set()
    assert tier.snapshot().worker_counts == ((0, 2, 1), (1, 2, 1))
    # A later enqueued count does not change the expectation; the second
    # worker's completions land transfer 0 (and an unknown id is ignored).
    assert tier.report_transfers({0: 5}, {0: 1, 99: 1}) == [0]
    assert tier.residency("r").clean == {0} and tier.residency("r").pending == {1, 2}
    assert tier.snapshot().worker_counts == ((1, 2, 1),)
    # Completions reported before the enqueue count wait for it.
    assert tier.report_transfers({}, {2: 1}) == []
    assert tier.report_transfers({2: 1}, {1: 1}) == [1, 2]
    assert tier.residency("r").clean == {0, 1, 2} and tier.snapshot().worker_counts == ()
    # No hot region yet: clean pages stay pinned, so the device pool is unchanged.
    assert tier.num_free_device_blocks() == 15 - 3
    _check(tier)


def test_report_refusals_change_nothing(make: Callable[..., Tier]) -> None:
    tier = make()
    assert tier.allocate("r", 2 * B) is not None
    tier.advance("r", 2 * B)
    before = tier.snapshot()
    with pytest.raises(InvalidArgumentError, match="enqueued"):
        tier.report_transfers({0: -1}, {0: 1})
    with pytest.raises(InvalidArgumentError, match="completed"):
        tier.report_transfers({0: 1}, {0: True})
    with pytest.raises(UnknownRequestError):
        tier.advance("nobody", 4)
    assert tier.snapshot() == before


def test_a_freed_requests_transfers_still_complete_by_count(make: Callable[..., Tier]) -> None:
    tier = make()
    assert tier.allocate("r", 2 * B) is not None
    tier.advance("r", 2 * B)
    tier.free("r")
    assert tier.num_free_host_blocks() == 15 - 2  # the transfers hold both host blocks
    assert tier.take_transfers() == [_writeback(0, 0, 1, 1), _writeback(1, 1, 2, 2)]
    assert tier.report_transfers({0: 1, 1: 1}, {0: 1, 1: 1}) == [0, 1]
    assert tier.num_free_host_blocks() == 15 and tier.num_free_device_blocks() == 15
    _check(tier)


def test_pop_for_free_keeps_what_an_in_flight_step_may_write(make: Callable[..., Tier]) -> None:
    tier = make(hot=1)
    assert tier.allocate("r", 3 * B) is not None  # host 1 2 3, device 1 2 3
    tier.advance("r", 3 * B)  # write-backs 0, 1, 2
    assert tier.report_transfers({0: 1}, {0: 1}) == [0]  # page 0 is clean
    tier.require_hot("r")
    assert tier.allocate("r", 3 * B) is not None  # hot region: device block 4
    hold = tier.pop_for_free("r")
    # Page 0 is clean: its block is released (a copy-free page); pages 1 and 2
    # are still being written back and the hot region may still be read.
    assert (hold.host_blocks, hold.resident_blocks, hold.hot_blocks) == ((1, 2, 3), (2, 3), (4,))
    assert "r" not in tier.requests
    assert tier.num_free_host_blocks() == 15 - 3
    assert tier.snapshot().device_free[-1] == 1 and tier.num_free_device_blocks() == 15 - 3
    _check(tier)
    tier.release_fence(hold.fence_id)
    # The in-flight write-backs still hold host 2, 3 and device 2, 3.
    assert tier.num_free_host_blocks() == 15 - 2 and tier.num_free_device_blocks() == 15 - 2
    assert tier.snapshot().device_free[-1] == 4  # the hot block goes back last
    assert tier.report_transfers({1: 1, 2: 1}, {1: 1, 2: 1}) == [1, 2]
    assert tier.num_free_host_blocks() == 15 and tier.num_free_device_blocks() == 15
    with pytest.raises(InvalidArgumentError, match="fence_id"):
        tier.release_fence(hold.fence_id)  # already released
    _check(tier)


def test_evicting_a_host_block_drops_its_hash_and_its_copy(make: Callable[..., Tier]) -> None:
    tier = make()
    hashes = [BlockHash(bytes([7, i])) for i in range(2)]
    assert tier.allocate("r", 2 * B, block_hashes=hashes) is not None
    tier.advance("r", 2 * B)
    tier.report_transfers({0: 1, 1: 1}, {0: 1, 1: 1})
    assert tier.lookup(hashes) == (1, 2)
    assert tier.snapshot().copies == ((hashes[0], 1), (hashes[1], 2))
    assert tier.evict_host_blocks([2, 5]) == [hashes[1]]  # block 5 holds no hash
    assert tier.lookup(hashes) == (1,)
    assert tier.snapshot().copies == ((hashes[0], 1),)
    before = tier.snapshot()
    with pytest.raises(InvalidArgumentError, match="block_ids"):
        tier.evict_host_blocks([1, 16])
    assert tier.snapshot() == before
    _check(tier)
