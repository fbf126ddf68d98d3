"""R-SWA gap release (``RSWASpec``, spec/managers.md §2a, RSWA-1, D-SPEC-19).
Worked example (spec/examples.md §15): blocks of 4 tokens, ``rswa_window``
4, a prompt of 6 tokens, a pool of 16 blocks (ids 1..15 free, in order). The
prompt's blocks (positions 0, 1) are read by every later token; a generated
block is released once the decode window has moved past it."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.attention_variants import RSWASpec
from pagedkv.spec.registry import manager_kind_for

N = 0  # the null block
PROMPT = [1, 2, 3, 4, 5, 6]


def rswa_manager(impl: ModuleType, *, with_full: bool = False, **kwargs: Any) -> Any:
    groups = [KVCacheGroupSpec(("rswa",), RSWASpec(4, 1, 8, "float16", rswa_window=4))]
    if with_full:
        groups.append(KVCacheGroupSpec(("full",), FullAttentionSpec(4, 1, 8, "float16")))
    return impl.KVCacheManager(KVCacheConfig(16, (), tuple(groups)), 256, hash_block_size=4, **kwargs)


def decode_to(manager: Any, request: Any, num_tokens: int) -> None:
    while request.num_computed_tokens < num_tokens:
        request.append_output_token_ids(9)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


def test_rswa_has_a_kind_of_its_own() -> None:
    assert manager_kind_for(RSWASpec(4, 1, 8, "float16", rswa_window=4)) == "rswa"


def test_gap_blocks_are_released_once_the_window_passes(impl: ModuleType) -> None:
    manager = rswa_manager(impl)
    a = manager.make_request("a", PROMPT)
    assert manager.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    decode_to(manager, a, 12)
    # At most 11 tokens settled so far: the window starts at most at max(6, 7) = 7;
    # positions cdiv(6, 4) = 2 up to 7 // 4 = 1: nothing released.
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    decode_to(manager, a, 16)
    # The step from 16 settled tokens: window start 12, position 2 (tokens 8..11)
    # is the gap: released. Position 1 holds prompt tokens 4, 5 and stays.
    decode_to(manager, a, 17)
    assert manager.get_block_ids("a") == ([1, 2, N, 4, 5],)
    # Block 3 was cached (full, tokens 8..11): it joins the back of the free queue.
    assert manager.snapshot().pool.free_queue[-1] == 3
    decode_to(manager, a, 21)
    assert manager.get_block_ids("a") == ([1, 2, N, N, 5, 6],)
    manager.check_invariants()


def test_a_hybrid_releases_in_group_order_and_hits_as_full_attention(impl: ModuleType) -> None:
    manager = rswa_manager(impl, with_full=True)
    a = manager.make_request("a", PROMPT)
    assert manager.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    decode_to(manager, a, 17)
    # Groups allocate in order (R-SWA first); the R-SWA group's gap block 5
    # went back to the free queue; the full group keeps every block.
    assert manager.get_block_ids("a") == ([1, 2, N, 7, 9], [3, 4, 6, 8, 10])
    # A later request with a's first 16 tokens hits them in both groups; the
    # released gap block 5 is still cached, so it serves the hit.
    b = manager.make_request("b", PROMPT + [9] * 10 + [7])
    hit, length = manager.get_computed_blocks(b)
    assert length == 16 and hit.get_block_ids() == ([1, 2, 5, 7], [3, 4, 6, 8])


def test_check_invariants_names_rswa_1(impl: ModuleType) -> None:
    """A planted bug (a block held twice in the R-SWA list) is named RSWA-1."""
    import pytest

    from pagedkv.spec.errors import InvariantViolation
    from tests.test_gates import Surgery

    manager = rswa_manager(impl)
    a = manager.make_request("a", PROMPT)
    manager.allocate_slots(a, 6)
    manager.check_invariants()
    surgery = Surgery(manager)
    first = surgery.ids(0)[0]
    surgery.put(0, None, first)
    surgery.add_ref(first, 1)  # REQ-1 still holds: the list names it twice
    with pytest.raises(InvariantViolation, match="^RSWA-1:"):
        manager.check_invariants()
