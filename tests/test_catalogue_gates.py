"""Planted bugs for the catalogue's IDs that tests/test_gates.py does not plant.

spec/invariants.md lists, for every ID, the test that catches its violation.
The IDs whose checker was added with the catalogue get their planted bug here:
a corruption in each implementation's state that ``check_invariants()`` must
report under that ID.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.spec import InvariantViolation
from tests.implementations import IMPLEMENTATIONS
from tests.test_gates import FULL, MAMBA, Surgery, _hybrid
from tests.test_hisparse_config import _busy_reference


def _record_partial_hit(s: Surgery, column: int, block_id: int) -> None:
    """Record a copy-on-write source for request "a" in the Mamba group, as
    an admission inside a block does (MPART-2)."""
    source: Any = s.pool.blocks[block_id] if s.is_reference else block_id
    s.groups[MAMBA].partial_hit["a"] = (column, source)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_mpart_2_a_partial_hit_naming_the_block_it_holds_passes(implementation: str) -> None:
    """The honest record: the real block the request holds at that column."""
    manager, _ = _hybrid(IMPLEMENTATIONS[implementation])
    surgery = Surgery(manager)
    column = max(i for i, block in enumerate(surgery.ids(MAMBA)) if block)
    _record_partial_hit(surgery, column, surgery.ids(MAMBA)[column])
    manager.check_invariants()


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("plant", ["another group's block", "a null column", "a column past the list"])
def test_mpart_2_a_partial_hit_naming_another_block_is_reported(implementation: str, plant: str) -> None:
    manager, _ = _hybrid(IMPLEMENTATIONS[implementation])
    surgery = Surgery(manager)
    mamba = surgery.ids(MAMBA)
    real = max(i for i, block in enumerate(mamba) if block)
    if plant == "another group's block":
        _record_partial_hit(surgery, real, surgery.ids(FULL)[0])
    elif plant == "a null column":
        _record_partial_hit(surgery, mamba.index(0), 0)
    else:
        _record_partial_hit(surgery, len(mamba), mamba[real])
    with pytest.raises(InvariantViolation, match="^MPART-2:"):
        manager.check_invariants()


def test_host_13_a_worker_count_for_a_transfer_not_in_flight_is_reported() -> None:
    """HOST-13's planted bug (the other HOST-* IDs have theirs in
    tests/test_hisparse_config.py): the worker reports on a transfer that
    is not in flight."""
    tier = _busy_reference()
    tier.worker_counts[tier.next_transfer_id + 7] = (1, 0)
    with pytest.raises(InvariantViolation, match="^HOST-13: "):
        tier.check_invariants()


def test_host_13_an_outbox_naming_an_unplanned_transfer_is_reported() -> None:
    tier = _busy_reference()
    tier.outbox.append(tier.next_transfer_id)
    with pytest.raises(InvariantViolation, match="^HOST-13: "):
        tier.check_invariants()


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_mpart_3_a_copy_endpoint_without_its_reference_is_reported(implementation: str) -> None:
    """MPART-3 (REQ-1 extended): a queued copy holds one reference on each
    endpoint. A copy queued without taking them breaks the count."""
    manager, _ = _hybrid(IMPLEMENTATIONS[implementation])
    surgery = Surgery(manager)
    source, destination = surgery.ids(FULL)[0], surgery.take()
    surgery.add_ref(destination, -1)  # the fresh block back to 0 references, as if never taken
    surgery.queue_held_block(destination)
    manager.check_invariants()  # the honest state: the block is free again
    pair: Any = ((surgery.pool.blocks[source], surgery.pool.blocks[destination]) if surgery.is_reference
                 else (source, destination))
    surgery.groups[MAMBA].copies.append(pair)
    with pytest.raises(InvariantViolation, match="^REQ-1:"):
        manager.check_invariants()
