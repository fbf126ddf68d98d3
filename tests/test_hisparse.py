"""Scenarios of the host tier (spec/host_tier.md), run on both implementations."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.optimized.host_tier.hisparse import HostTierManager as OptimizedTier
from pagedkv.reference.features.hisparse import HostTierManager as ReferenceTier
from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    InvalidArgumentError,
    UnknownRequestError,
)
from pagedkv.spec.hisparse import (
    HostTierConfig,
)
from pagedkv.spec.types import BlockHash

Tier = ReferenceTier | OptimizedTier
B = 4


def _hashes(n: int, tag: int = 0) -> list[BlockHash]:
    return [BlockHash(bytes([tag, i])) for i in range(n)]


@pytest.fixture(params=[ReferenceTier, OptimizedTier], ids=["reference", "optimized"])
def make(request: pytest.FixtureRequest) -> Callable[..., Tier]:
    def build(host: int = 16, device: int = 16, hot: int = 2, **kwargs: object) -> Tier:
        tier: Tier = request.param(HostTierConfig(
            block_size=B, host_num_blocks=host, device_num_blocks=device,
            hot_blocks_per_request=hot, max_model_len=64, **kwargs))  # type: ignore[arg-type]
        return tier
    return build


def _check(tier: Tier) -> None:
    if isinstance(tier, ReferenceTier):
        tier.check_invariants()


def test_every_page_gets_a_host_block_and_a_resident_block(make: Callable[..., Tier]) -> None:
    tier = make()
    allocation = tier.allocate("r", 10)
    assert allocation is not None
    assert len(allocation.host_blocks) == len(allocation.resident_blocks) == 3
    assert allocation.hot_blocks == ()  # a cold prefill needs no hot region
    assert tier.num_free_host_blocks() == 12 and tier.num_free_device_blocks() == 12
    _check(tier)


def test_host_exhaustion_defers_allocation_and_changes_nothing(make: Callable[..., Tier]) -> None:
    tier = make(host=4, device=16)  # 3 usable host blocks
    assert tier.allocate("a", 8) is not None
    before = tier.snapshot()
    assert tier.allocate("b", 8) is None  # 2 pages, 1 host block left
    assert tier.snapshot() == before
    assert tier.allocate("a", 13) is None  # growth is deferred the same way
    assert tier.snapshot() == before
    assert tier.allocate("a", 12) is not None
    _check(tier)


def test_blocks_needed_predicts_allocate_and_changes_nothing(make: Callable[..., Tier]) -> None:
    tier = make(host=6, device=6, hot=2)
    before = tier.snapshot()
    assert tier.blocks_needed("a", 12) == (3, 3)
    assert tier.blocks_needed("a", 12, num_external_tokens=12) == (3, 3)  # 1 resident + hot 2
    assert tier.snapshot() == before  # a query asks for no hot region and takes nothing
    assert tier.blocks_needed("a", 24) == (6, 6)
    assert tier.allocate("a", 24) is None  # 5 free blocks per pool
    tier.allocate("a", 12)
    tier.require_hot("a")
    assert tier.blocks_needed("a", 16) == (1, 3)  # one page and the hot region


def test_an_in_flight_writeback_keeps_the_host_pool_exhausted_until_it_lands(
        make: Callable[..., Tier]) -> None:
    # The shape of vLLM 0.33's host-exhaustion scenario, in pagedkv's API: a
    # 4-block host pool, a one-page donor whose write-back is in flight.
    tier = make(host=5, device=32, hot=2)
    tier.allocate("donor", 4)
    donor_copy = tier.plan_writebacks("donor", 4)
    assert tier.allocate("r", 16) is None  # 4 pages, 3 free host blocks
    tier.free("donor")
    assert tier.allocate("r", 16) is None  # the write-back still holds the donor's host block
    tier.complete([t.transfer_id for t in donor_copy])
    assert tier.allocate("r", 16) is not None
    assert 0 not in tier.residency("r").host_row
    tier.complete([t.transfer_id for t in tier.plan_writebacks("r", 16)])
    tier.require_hot("r")
    tier.allocate("r", 16)
    tier.update_residency("r")
    row = tier.residency("r")
    assert row.unpinned == frozenset({0, 1})  # the two tail pages stay pinned
    snapshot = tier.snapshot()
    assert [b in snapshot.device_free for b in row.resident_row] == [True, True, False, False]
    _check(tier)


def test_full_sequence_admission_caps_resident_pages_at_the_window(
        make: Callable[..., Tier]) -> None:
    # 8 pages of context, a 2-page in-flight window: 8 host blocks but 2 device blocks.
    tier = make(host=9, device=3, admission_window=2)
    assert tier.full_sequence_blocks("r", 32) == (8, 2)
    assert tier.allocate("r", 4) is not None
    assert tier.full_sequence_blocks("r", 32) == (7, 1)
    tier.require_hot("r")
    assert tier.full_sequence_blocks("r", 32) == (7, 3)  # and the hot region
    with pytest.raises(ExceedsMaxModelLenError):
        tier.full_sequence_blocks("r", 65)


def test_device_exhaustion_refuses_even_when_the_host_has_room(make: Callable[..., Tier]) -> None:
    tier = make(host=16, device=3)
    before = tier.snapshot()
    assert tier.allocate("a", 12) is None
    assert tier.snapshot() == before


def test_writeback_then_publication_then_host_hit(make: Callable[..., Tier]) -> None:
    tier = make()
    hashes = _hashes(3)
    tier.allocate("a", 14, block_hashes=hashes)
    transfers = tier.plan_writebacks("a", 14)
    # Only sealed pages (14 // 4 = 3) are written back; each is pending once.
    assert [t.page for t in transfers] == [0, 1, 2]
    assert tier.plan_writebacks("a", 14) == []
    assert tier.lookup(hashes) == ()  # nothing is published before it is durable
    tier.complete([transfers[1].transfer_id])
    assert tier.lookup(hashes) == ()  # page 0 is not clean yet: the prefix stops there
    tier.complete([transfers[0].transfer_id, transfers[2].transfer_id])
    hit = tier.lookup(hashes)
    original = tier.residency("a")
    assert hit == original.host_row[:3]
    tier.free("a")
    allocation = tier.allocate("b", 16, hit=hit, block_hashes=hashes + _hashes(1, 9))
    assert allocation is not None
    row = tier.residency("b")
    # The freed pages' device blocks survived in the free queue: the hit adopts them.
    assert row.resident_row[:3] == original.resident_row[:3]
    assert len(allocation.resident_blocks) == 1
    assert len(allocation.hot_blocks) == 2  # reading host-backed history needs the hot region
    _check(tier)


def test_a_hit_adopts_only_copies_the_pool_has_not_handed_out(make: Callable[..., Tier]) -> None:
    tier = make(device=8, hot=1)
    hashes = _hashes(3)
    tier.allocate("a", 12, block_hashes=hashes)
    tier.complete([t.transfer_id for t in tier.plan_writebacks("a", 12)])
    original = tier.residency("a").resident_row
    tier.free("a")
    assert len(tier.snapshot().copies) == 3  # clean pages of a finished request stay readable
    tier.allocate("filler", 4 * 5)  # 4 never-used blocks, then page 2's copy (freed first)
    assert len(tier.snapshot().copies) == 2
    tier.free("filler")
    assert tier.allocate("b", 12, hit=tier.lookup(hashes), block_hashes=hashes) is not None
    row = tier.residency("b").resident_row
    # Page 2's copy went to the filler, page 1's to b's own hot region (taken before
    # adoption: admission did not count on copies); page 0's survives and is adopted.
    assert row == (original[0], 0, 0)
    _check(tier)
    tier.free("b")
    assert tier.reset_host_cache() and tier.snapshot().copies == ()  # reset forgets copies


def test_clean_pages_are_released_only_with_a_hot_region_and_outside_the_tail(
        make: Callable[..., Tier]) -> None:
    tier = make()
    tier.allocate("a", 20)
    ids = [t.transfer_id for t in tier.plan_writebacks("a", 20)]
    tier.complete(ids)
    assert tier.residency("a").unpinned == frozenset()  # no hot region: all stay pinned
    tier.require_hot("a")
    assert tier.allocate("a", 20) is not None
    tier.update_residency("a")
    # 5 pages, the last 2 are the active tail; the rest are released.
    assert tier.residency("a").unpinned == frozenset({0, 1, 2})
    _check(tier)


def test_a_reused_unpinned_block_loses_its_page(make: Callable[..., Tier]) -> None:
    tier = make(device=10, hot=1)
    tier.allocate("a", 20)
    tier.complete([t.transfer_id for t in tier.plan_writebacks("a", 20)])
    tier.require_hot("a")
    tier.allocate("a", 20)
    tier.update_residency("a")
    unpinned_block = tier.residency("a").resident_row[2]  # released first: tail first
    never_used = tier.num_free_device_blocks() - 3  # pages 0..2 were released behind them
    assert tier.allocate("b", 4 * never_used) is not None  # takes never-used blocks only
    assert tier.residency("a").resident_row[2] == unpinned_block
    assert tier.allocate("b", 4 * (never_used + 1)) is not None  # now one released block goes
    row = tier.residency("a")
    assert row.resident_row[2] == 0 and 2 not in row.unpinned and row.hot_required
    _check(tier)


def test_residency_updates_send_only_what_changed(make: Callable[..., Tier]) -> None:
    tier = make(device=10, hot=1)
    tier.allocate("a", 20)
    first = tier.take_residency_updates(["a"])["a"]
    assert first.pages == (0, 1, 2, 3, 4) and 0 not in first.block_ids
    assert tier.take_residency_updates(["a"]) == {}  # nothing new
    tier.complete([t.transfer_id for t in tier.plan_writebacks("a", 20)])
    tier.require_hot("a")
    tier.allocate("a", 24)  # hot region and a sixth page
    tier.update_residency("a")  # pages 0..3 released, page 3 first
    assert tier.fully_resident("a")
    tier.allocate("b", 4 * (tier.num_free_device_blocks() - 4 + 1))  # reuses page 3's block
    assert not tier.fully_resident("a")
    update = tier.take_residency_updates(["a", "b"])
    assert update["a"].pages == (3, 5) and update["a"].block_ids[0] == 0  # stale page, new page
    tier.free("a")
    tier.allocate("a", 8)
    assert tier.take_residency_updates(["a"])["a"].pages == (0, 1)  # readmitted: everything
    with pytest.raises(UnknownRequestError):
        tier.take_residency_updates(["a", "nobody"])


def test_row_mirrors_follow_pages_across_tiers(make: Callable[..., Tier]) -> None:
    from pagedkv.spec.hisparse import RowMirror

    tier = make()
    tier.allocate("a", 8)
    row = tier.residency("a")
    # Tokens 2..5 straddle pages 0 and 1: one mirror per page.
    assert tier.row_mirrors("a", 2, 4) == [
        RowMirror(row.resident_row[0] * B + 2, row.host_row[0] * B + 2, 2),
        RowMirror(row.resident_row[1] * B, row.host_row[1] * B, 2),
    ]
    assert tier.row_mirrors("a", 6, 10) == [
        RowMirror(row.resident_row[1] * B + 2, row.host_row[1] * B + 2, 2)]  # beyond the row


def test_the_worked_example_of_host_tier_md(make: Callable[..., Tier]) -> None:
    tier = make(host=10, device=10, hot=1)
    tier.allocate("a", 20)
    assert tier.residency("a").resident_row == (1, 2, 3, 4, 5)
    tier.take_residency_updates(["a"])
    tier.complete([t.transfer_id for t in tier.plan_writebacks("a", 20)])
    tier.require_hot("a")
    allocation = tier.allocate("a", 20)
    assert allocation is not None and allocation.hot_blocks == (6,)
    tier.update_residency("a")
    assert tier.snapshot().device_free == (7, 8, 9, 3, 2, 1)
    allocation = tier.allocate("b", 16)
    assert allocation is not None and allocation.resident_blocks == (7, 8, 9, 3)
    assert tier.residency("a").resident_row == (1, 2, 0, 4, 5)
    assert tier.take_residency_updates(["a"])["a"].pages == (2,)
    _check(tier)


def test_low_device_pool_asks_for_a_hot_region(make: Callable[..., Tier]) -> None:
    tier = make(device=8, hot=1, watermark=4)
    tier.allocate("a", 16)  # 4 of 7 free blocks used
    tier.update_residency("a")
    assert tier.residency("a").hot_required
    assert tier.allocate("a", 16) is not None
    assert tier.can_read_from_host("a")


def test_filling_the_admission_window_asks_for_a_hot_region(make: Callable[..., Tier]) -> None:
    tier = make(device=32, hot=1, watermark=0, admission_window=3)
    tier.allocate("a", 8)
    tier.update_residency("a")
    assert not tier.residency("a").hot_required  # 2 pages: inside the window, plenty free
    tier.allocate("a", 12)
    tier.update_residency("a")
    assert tier.residency("a").hot_required  # 3 pages fill the window


def test_restore_brings_a_host_page_back(make: Callable[..., Tier]) -> None:
    tier = make(device=6)
    hashes = _hashes(2)
    tier.allocate("a", 8, block_hashes=hashes)
    tier.complete([t.transfer_id for t in tier.plan_writebacks("a", 8)])
    tier.free("a")
    tier.allocate("filler", 20)  # every device block: the device copies are gone
    tier.free("filler")
    tier.allocate("b", 8, hit=tier.lookup(hashes), block_hashes=hashes)
    assert tier.residency("b").resident_row == (0, 0)
    transfer = tier.plan_restore("b", 1)
    assert transfer is not None and transfer.kind == "restore"
    assert tier.residency("b").resident_row[1] == 0  # not readable until it completes
    tier.complete([transfer.transfer_id])
    assert tier.residency("b").resident_row[1] == transfer.device_block
    with pytest.raises(InvalidArgumentError, match="host-only"):
        tier.plan_restore("b", 1)
    _check(tier)


def test_free_keeps_in_flight_transfers_alive(make: Callable[..., Tier]) -> None:
    tier = make()
    tier.allocate("a", 8, block_hashes=_hashes(2))
    transfers = tier.plan_writebacks("a", 8)
    tier.free("a")
    _check(tier)
    assert tier.num_free_host_blocks() == 13  # the two transfers still hold their host blocks
    tier.complete([t.transfer_id for t in transfers])
    assert tier.num_free_host_blocks() == 15
    assert tier.lookup(_hashes(2)) == ()  # a freed request's late copies are not published
    _check(tier)


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 31, 32, 33, 63])
def test_an_import_keeps_only_its_last_page_resident(make: Callable[..., Tier],
                                                     num_tokens: int) -> None:
    tier = make(host=20, device=20)
    hashes = _hashes(num_tokens // B)
    allocation = tier.allocate("r", num_tokens, block_hashes=hashes,
                               num_external_tokens=num_tokens)
    assert allocation is not None and len(allocation.resident_blocks) == 1
    row = tier.residency("r")
    pages = -(-num_tokens // B)
    assert len(row.host_row) == len(row.resident_row) == pages
    assert row.resident_row[:-1] == (0,) * (pages - 1) and row.resident_row[-1] != 0
    assert row.hot_required and len(allocation.hot_blocks) == 2
    assert tier.plan_writebacks("r", num_tokens) == []  # the import is writing those pages
    _check(tier)
    restore = tier.finish_import("r")
    assert restore is not None and restore.kind == "restore"
    assert (restore.host_block, restore.device_block) == (row.host_row[-1], row.resident_row[-1])
    assert tier.residency("r").clean == frozenset(range(num_tokens // B))
    assert tier.lookup(hashes) == row.host_row[: num_tokens // B]  # sealed pages published
    _check(tier)
    tier.complete([restore.transfer_id])
    assert tier.residency("r").resident_row[-1] == row.resident_row[-1]
    _check(tier)


def test_a_failed_import_frees_the_request(make: Callable[..., Tier]) -> None:
    tier = make()
    before = tier.snapshot()
    tier.allocate("r", 20, num_external_tokens=20)
    assert tier.finish_import("r", failed=True) is None
    assert tier.snapshot().requests == before.requests == ()
    with pytest.raises(InvalidArgumentError, match="num_external_tokens"):
        tier.allocate("r", 4, num_external_tokens=5)


def test_a_finished_request_publishes_its_prefix_when_its_copies_land(
        make: Callable[..., Tier]) -> None:
    tier = make()
    hashes = _hashes(3)
    tier.allocate("a", 12, block_hashes=hashes)
    first, *rest = tier.plan_writebacks("a", 12)
    tier.complete([first.transfer_id])
    assert tier.lookup(hashes) == tier.residency("a").host_row[:1]
    host_row = tier.residency("a").host_row
    tier.free("a", finished=True)
    assert tier.num_free_host_blocks() == 15 - 3  # held for the late publication
    tier.complete([rest[0].transfer_id])
    assert len(tier.lookup(hashes)) == 1  # page 2 is still in flight: nothing more yet
    _check(tier)
    tier.complete([rest[1].transfer_id])
    assert tier.lookup(hashes) == host_row  # the whole durable prefix, once all landed
    assert tier.num_free_host_blocks() == 15 and tier.snapshot().detached == ()
    _check(tier)


def test_refusals_are_typed_and_change_nothing(make: Callable[..., Tier]) -> None:
    tier = make()
    tier.allocate("a", 8, block_hashes=_hashes(2))
    before = tier.snapshot()
    with pytest.raises(ExceedsMaxModelLenError):
        tier.allocate("a", 65)
    with pytest.raises(InvalidArgumentError, match="hit"):
        tier.allocate("b", 8, hit=(1,), block_hashes=_hashes(2))  # block 1 carries no hash
    with pytest.raises(InvalidArgumentError, match="transfer"):
        tier.complete([99])
    with pytest.raises(UnknownRequestError):
        tier.free("nobody")
    assert tier.snapshot() == before
    assert tier.reset_host_cache() is False
    tier.free("a")
    assert tier.reset_host_cache() is True
