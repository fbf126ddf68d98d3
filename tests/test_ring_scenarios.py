"""Ring groups (``CircularBufferSpec``, spec/managers.md §9, RING-1, D-SPEC-18):
one block per request beside paged groups, outside prefix caching. Worked
example (spec/examples.md §14, "A ring beside full attention"): full
attention with blocks of 4 tokens and a ring of 8 rows, a pool of 16 blocks
(ids 1..15 free, in order)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.attention_variants import CircularBufferSpec

PROMPT = list(range(10))


def ring_manager(impl: ModuleType, ring_rows: int = 8, **kwargs: Any) -> Any:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(4, 1, 8, "float16")),
              KVCacheGroupSpec(("ring",), CircularBufferSpec(ring_rows, 1, 8, "float16")))
    return impl.KVCacheManager(KVCacheConfig(16, (), groups), 256, hash_block_size=4, **kwargs)


def test_a_request_claims_one_ring_block_at_its_first_allocation(impl: ModuleType) -> None:
    manager = ring_manager(impl)
    a = manager.make_request("a", PROMPT)
    new = manager.allocate_slots(a, 10)
    # Group order: full attention takes 1, 2, 3; the ring takes 4.
    assert new.get_block_ids() == ([1, 2, 3], [4])
    a.num_computed_tokens = 10
    for _ in range(6):  # decode to 16 tokens: one more full block, never a ring block
        a.append_output_token_ids(7)
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert manager.get_block_ids("a") == ([1, 2, 3, 5], [4])
    # The ring block never carries a key; the full blocks 1..3 do (12 tokens filled).
    hashes = manager.snapshot().pool.block_hashes
    assert hashes[4] is None and all(hashes[b] is not None for b in (1, 2, 3))


def test_a_hit_leaves_the_ring_out_and_the_ring_is_claimed_fresh(impl: ModuleType) -> None:
    manager = ring_manager(impl)
    a = manager.make_request("a", PROMPT)
    manager.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    b = manager.make_request("b", PROMPT)
    hit, length = manager.get_computed_blocks(b)
    # The ring's block size (8) does not bound the alignment: a hit of 8 tokens
    # is two full blocks and nothing in the ring.
    assert length == 8 and hit.get_block_ids() == ([1, 2], [])
    new = manager.allocate_slots(b, 2, length, hit)
    assert new.get_block_ids() == ([5], [6])
    assert manager.get_block_ids("b") == ([1, 2, 5], [6])


def test_external_tokens_claim_the_ring_in_group_order(impl: ModuleType) -> None:
    manager = ring_manager(impl)
    c = manager.make_request("c", PROMPT)
    # 8 tokens from a connector, 2 to compute: the full group's external blocks
    # (1, 2) come first, then the ring (3), then the full group's new block (4).
    manager.allocate_slots(c, 2, 0, None, 0, 8)
    assert manager.get_block_ids("c") == ([1, 2, 4], [3])


def test_release_returns_the_ring_block_and_admission_counts_one(impl: ModuleType) -> None:
    manager = ring_manager(impl)
    a = manager.make_request("a", PROMPT)
    manager.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    manager.free(a)
    # Uncached blocks go to the front of the queue: the ring block first
    # (released after the full group's), cached full blocks at the back.
    assert manager.snapshot().pool.free_queue[:1] == (4,)
    # Full-sequence admission: a 56-token request needs 14 full blocks and one
    # ring block; 15 are free, so it fits; 60 tokens (15 + 1) do not.
    fits = manager.make_request("fits", list(range(100, 156)))
    assert manager.allocate_slots(fits, 4, full_sequence_must_fit=True) is not None
    manager.free(fits)
    too_long = manager.make_request("long", list(range(200, 260)))
    assert manager.allocate_slots(too_long, 4, full_sequence_must_fit=True) is None


@pytest.mark.parametrize("corruption", ["second_block", "keyed_block"])
def test_check_invariants_names_ring_1(impl: ModuleType, corruption: str) -> None:
    """A planted bug (a second ring block, or a keyed one) is named RING-1."""
    from pagedkv.spec.errors import InvariantViolation
    from tests.test_gates import Surgery

    manager = ring_manager(impl)
    manager.allocate_slots(manager.make_request("a", PROMPT), 10)
    manager.check_invariants()
    surgery = Surgery(manager)
    if corruption == "second_block":
        surgery.put(1, None, surgery.take())  # held once more, so REQ-1 still holds
    else:
        surgery.set_key(surgery.ids(1)[0], b"\7" * 32, 1)
    with pytest.raises(InvariantViolation, match="^RING-1:"):
        manager.check_invariants()
