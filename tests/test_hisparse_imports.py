"""Scenarios of the host tier's imports and host-block holds (spec/host_tier.md,
HOST-14 and later), run on both implementations with concrete block ids."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.spec.errors import InvalidArgumentError
from tests.test_hisparse import Tier, _check, _hashes, make

__all__ = ["make"]  # the fixture, shared with tests/test_hisparse.py

B = 4


def _published_and_freed(tier: Tier, num_pages: int) -> list[int]:
    """Request "a" computes ``num_pages`` pages, writes them back, is freed;
    returns its host row (every page published, each with a device copy)."""
    hashes = _hashes(num_pages)
    assert tier.allocate("a", num_pages * B, block_hashes=hashes) is not None
    tier.complete([t.transfer_id for t in tier.plan_writebacks("a", num_pages * B)])
    host_row = list(tier.residency("a").host_row)
    tier.free("a")
    return host_row


def test_an_import_can_complete_a_host_hit_longer_than_the_computed_prefix(
        make: Callable[..., Tier]) -> None:
    """HOST-14: the host holds pages 0..2 but the engine counts only 0..1 as
    computed (the device groups lost page 2); a connector loads tokens 8..12.
    Page 2 keeps its host block from the hit, is not clean until the import
    lands, gets a device block for the replayed token, and is restored."""
    tier = make()
    host_row = _published_and_freed(tier, 4)
    assert host_row == [1, 2, 3, 4]
    hashes = _hashes(4)
    hit = tier.lookup(hashes)[:3]
    # Host: one new page and the three hit blocks, free since a left; device:
    # pages 2 and 3 and the hot region (copies are never counted on).
    assert tier.blocks_needed("b", 13, hit, hashes, 4, 8) == (4, 4)
    allocation = tier.allocate("b", 13, hit, hashes, num_external_tokens=4, num_local_tokens=8)
    assert allocation is not None
    row = tier.residency("b")
    assert row.host_row == (1, 2, 3, 5)
    # Pages 0, 1 adopt a's copies; page 2 (the import's last) and 3 get fresh blocks.
    assert row.resident_row == (1, 2, 5, 6) and row.hot == (7, 8)
    assert row.clean == frozenset({0, 1}) and row.published == 2 and row.importing == 12
    with pytest.raises(InvalidArgumentError):
        tier.plan_restore("b", 2)  # the import has not landed: page 2 is not clean
    assert tier.plan_writebacks("b", 13) == []
    _check(tier)
    restore = tier.finish_import("b")
    assert restore is not None
    assert (restore.page, restore.host_block, restore.device_block) == (2, 3, 5)
    assert tier.residency("b").clean == frozenset({0, 1, 2})
    assert tier.residency("b").published == 3
    _check(tier)


def test_a_hit_past_the_computed_prefix_needs_an_import_covering_it(
        make: Callable[..., Tier]) -> None:
    tier = make()
    _published_and_freed(tier, 4)
    hashes = _hashes(4)
    hit = tier.lookup(hashes)[:3]
    before = tier.snapshot()
    with pytest.raises(InvalidArgumentError, match="past the 2 computed pages"):
        tier.allocate("b", 13, hit, hashes, num_local_tokens=8)  # no import
    with pytest.raises(InvalidArgumentError, match="past the 1 computed pages"):
        tier.allocate("b", 13, hit, hashes, num_external_tokens=4, num_local_tokens=4)
    with pytest.raises(InvalidArgumentError, match="whole pages"):
        tier.allocate("b", 13, hit, hashes, num_external_tokens=4, num_local_tokens=6)
    assert tier.snapshot() == before


def test_the_checker_names_a_broken_import() -> None:
    """HOST-14 by ID: the import's last page counted clean before it landed."""
    from pagedkv.reference.features.hisparse import HostTierManager
    from pagedkv.spec.errors import InvariantViolation
    from pagedkv.spec.hisparse import HostTierConfig

    tier = HostTierManager(HostTierConfig(block_size=B, host_num_blocks=16, device_num_blocks=16,
                                          hot_blocks_per_request=2, max_model_len=64))
    _published_and_freed(tier, 4)
    hashes = _hashes(4)
    tier.allocate("b", 13, tier.lookup(hashes)[:3], hashes, num_external_tokens=4,
                  num_local_tokens=8)
    tier.check_invariants()
    tier.requests["b"].clean.add(2)
    with pytest.raises(InvariantViolation, match="^HOST-14: "):
        tier.check_invariants()


def test_callers_outside_any_request_take_and_give_back_host_blocks(
        make: Callable[..., Tier]) -> None:
    """D-HOST-23: take_host hands out the front of the host free queue, evicting
    a cached block's hash and its device copy; free_host gives blocks back."""
    tier = make(host=6)
    assert _published_and_freed(tier, 2) == [1, 2]
    assert tier.snapshot().host_free == (3, 4, 5, 2, 1)  # a's row went back tail first
    assert tier.take_host(4) == (3, 4, 5, 2)
    assert tier.lookup(_hashes(2)) == (1,)  # block 2 lost page 1's hash...
    assert len(tier.snapshot().copies) == 1  # ...and its device copy
    assert tier.snapshot().host_taken == (2, 3, 4, 5)
    before = tier.snapshot()
    assert tier.take_host(2) is None  # one block left: nothing changes
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        tier.take_host(-1)
    with pytest.raises(InvalidArgumentError, match="does not hold"):
        tier.free_host([5, 1])  # block 1 was never taken
    assert tier.snapshot() == before
    tier.free_host([5, 3])
    assert tier.snapshot().host_free == (1, 5, 3) and tier.snapshot().host_taken == (2, 4)
    with pytest.raises(InvalidArgumentError, match="does not hold"):
        tier.free_host([5])
    assert not tier.reset_host_cache()  # a taken block is a held host block
    _check(tier)


def test_a_capacity_query_counts_uncached_hits_and_a_partial_page(
        make: Callable[..., Tier]) -> None:
    """D-HOST-23: capacity_needed takes the hit as given (allocate would refuse
    a block the cache does not hold, D-HOST-8), counts a free hit block, and
    one host block for copying a hit page the computed tokens end inside."""
    tier = make()
    (b,) = tier.take_host(1) or ()
    with pytest.raises(InvalidArgumentError, match="not the host block cached"):
        tier.blocks_needed("w", 8, [b], _hashes(2), 4, 4)
    # Import of tokens 4..8 after one computed page: host page 1, device page 1 + hot.
    assert tier.capacity_needed("w", 8, [b], 4, 4) == (1, 3)
    assert tier.capacity_needed("w", 8, [b], 5, 3) == (2, 3)  # page 0 copied first
    tier.free_host([b])
    assert tier.capacity_needed("w", 8, [b], 4, 4) == (2, 3)  # the hit is free again
    assert tier.capacity_needed("w", 8, [b]) == (2, 3)  # no import: page 1 + hot
    assert "w" not in tier.requests
    _check(tier)


def test_host_cache_changes_are_recorded_as_events(make: Callable[..., Tier]) -> None:
    """D-HOST-26: a publication is one ``stored`` event per run of pages that
    entered the host cache; an eviction, on reuse or named, a ``removed`` one."""
    from pagedkv.spec.hisparse import HostCacheEvent

    tier = make(host=6, record_events=True)
    hashes = _hashes(3)
    tier.allocate("a", 12, block_hashes=hashes)
    transfers = tier.plan_writebacks("a", 12)
    tier.complete([transfers[1].transfer_id])
    assert tier.take_host_events() == []  # page 0 is not durable: nothing published
    tier.complete([transfers[0].transfer_id, transfers[2].transfer_id])
    assert tier.take_host_events() == [
        HostCacheEvent("stored", tuple(hashes), (1, 2, 3), "a", 0, None, False)]
    tier.free("a")
    tier.allocate("b", 12, block_hashes=_hashes(3, 7))  # 4, 5, then 3 (freed tail first)
    assert tier.take_host_events() == [HostCacheEvent("removed", (hashes[2],))]
    assert tier.evict_host_blocks([1, 4]) == [hashes[0]]
    assert tier.take_host_events() == [HostCacheEvent("removed", (hashes[0],))]
    tier.complete([t.transfer_id for t in tier.plan_writebacks("b", 8)])
    tier.free("b", finished=True)
    assert tier.take_host_events() == [
        HostCacheEvent("stored", tuple(_hashes(2, 7)), (4, 5), "b", 0, None, False)]
    assert make(host=6).take_host_events() == []  # not recorded unless asked
    _check(tier)


def test_a_late_publication_is_a_detached_event_after_its_parent(
        make: Callable[..., Tier]) -> None:
    from pagedkv.spec.hisparse import HostCacheEvent

    tier = make(record_events=True)
    hashes = _hashes(3, 5)
    tier.allocate("c", 12, block_hashes=hashes)
    first, *rest = tier.plan_writebacks("c", 12)
    tier.complete([first.transfer_id])
    assert tier.take_host_events() == [
        HostCacheEvent("stored", (hashes[0],), (1,), "c", 0, None, False)]
    tier.free("c", finished=True)  # pages 1, 2 still being written back
    tier.allocate("c", 4, block_hashes=_hashes(1, 6))  # the id is reused meanwhile
    tier.complete([t.transfer_id for t in rest])
    assert tier.take_host_events() == [
        HostCacheEvent("stored", tuple(hashes[1:]), (2, 3), "c", 1, hashes[0], True)]
    _check(tier)
