"""EAGLE beside full attention whose block spans several hash blocks, and the
EAGLE resume (shared-prefix) checkpoint (spec/mamba.md FPART-5, MPART-5,
MPART-6; D-MAMBA-38..41; spec/examples.md §19), one suite over every
implementation.

The block ids are those vLLM 0.33 hands out for the same calls (checked
against vLLM's own manager when these examples were written).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.reference.features.dcp_rules import prompt_tail_boundary
from pagedkv.reference.features.eagle_rules import sub_block_eagle_limit
from pagedkv.reference.features.mamba_partial_rules import resume_position
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.mamba_spec import MambaSpec
from tests.implementations import IMPLEMENTATIONS

N = 0  # the null block


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    module: ModuleType = IMPLEMENTATIONS[request.param]
    return module


def hybrid(impl: ModuleType, *, full: int, mamba: int, hash_block_size: int, num_blocks: int = 20,
           retention_interval: int | None = None, use_eagle: bool = True, num_prefill_lookahead: int = 0) -> Any:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(full, 1, 1, "float32")),
              KVCacheGroupSpec(("mamba",), MambaSpec(mamba, shapes=((1,),), dtypes=("float32",),
                                                     mamba_cache_mode="align")))
    return impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 1024, hash_block_size=hash_block_size,
                               use_eagle=use_eagle, retention_interval=retention_interval,
                               num_prefill_lookahead=num_prefill_lookahead)


def ids(manager: Any, request_id: str) -> list[list[int]]:
    return [list(group) for group in manager.get_block_ids(request_id)]


def keyed(manager: Any, block: int) -> bool:
    return manager.snapshot().pool.block_hashes[block] is not None


def run_chunks(manager: Any, request: Any, ends: list[int]) -> None:
    """Compute ``request`` in chunks ending at ``ends``, one step each."""
    for end in ends:
        assert manager.allocate_slots(request, end - request.num_computed_tokens) is not None
        request.num_computed_tokens = end
        manager.new_step_starts()
        manager.check_invariants()


def test_the_limits_and_boundaries() -> None:
    # FPART-5: one hash block past the cap, never past the hashed tokens.
    assert sub_block_eagle_limit(19, 20, 4) == 20
    assert sub_block_eagle_limit(11, 20, 4) == 15
    # D-MAMBA-39: an EAGLE group publishes up to the whole prompt, others one token short.
    assert prompt_tail_boundary(12, 3, 4, use_eagle=True) == 12
    assert prompt_tail_boundary(12, 3, 4) == 8
    assert prompt_tail_boundary(13, 3, 4, use_eagle=True) == 12
    assert prompt_tail_boundary(0, 0, 4) == 0
    # MPART-4..6: the prompt tail always; the junction only with the switch, inside the chunk and the prompt.
    common = dict(num_prompt_tokens=17, hash_block_size=4, drop_eagle_block=True, num_hash_lookahead_tokens=0,
                  shared_prefix_boundary=8, num_computed_tokens=4)
    assert resume_position(12, shared_prefix_checkpoint=False, **common)  # type: ignore[arg-type]
    assert not resume_position(8, shared_prefix_checkpoint=False, **common)  # type: ignore[arg-type]
    assert resume_position(8, shared_prefix_checkpoint=True, **common)  # type: ignore[arg-type]
    past = dict(common, num_computed_tokens=8)
    assert not resume_position(8, shared_prefix_checkpoint=True, **past)  # type: ignore[arg-type]
    beyond = dict(common, shared_prefix_boundary=20)
    assert not resume_position(20, shared_prefix_checkpoint=True, **beyond)  # type: ignore[arg-type]


def test_eagle_beside_a_full_attention_block_larger_than_the_hash_block_is_supported(impl: ModuleType) -> None:
    """D-MAMBA-38 replaces the refusal D-MAMBA-21 kept for EAGLE."""
    manager = hybrid(impl, full=8, mamba=4, hash_block_size=4)
    manager.enable_partial_hash_hits(2)
    assert manager.coordinator.partial_hits_enabled is True


@pytest.mark.parametrize("retention_interval", [None, 0])
def test_eagle_gives_back_one_hash_block_inside_a_full_attention_block(impl: ModuleType,
                                                                       retention_interval: int | None) -> None:
    """spec/examples.md §19: DCP 2 (full attention 8, Mamba 4, hash 4), EAGLE.
    The owner's 17-token prompt runs in chunks ending at 12 (its last
    reusable boundary under EAGLE) and 17. A sibling sharing all 17 tokens
    matches full attention to 16, gives back one hash block and hits 12
    inside block 2, which it copies (block-granular, EAGLE would give back
    the whole block: 8)."""
    manager = hybrid(impl, full=8, mamba=4, hash_block_size=4, retention_interval=retention_interval)
    manager.enable_partial_hash_hits(2)
    owner = manager.make_request("owner", list(range(17)))
    run_chunks(manager, owner, [12])
    assert ids(manager, "owner") == [[1, 2], [N, N, 3]]
    # Mamba's state at 12 is keyed: under retention 0 by MPART-5 alone (the
    # mask keeps only the replay position 8, which no state block holds).
    assert keyed(manager, 3)
    run_chunks(manager, owner, [17])
    assert ids(manager, "owner") == [[1, 2, 4], [N, N, 3, N, 5]]
    assert keyed(manager, 2) and keyed(manager, 3)
    manager.free(owner)
    manager.new_step_starts()

    replay = manager.make_request("replay", list(range(17)) + [100, 101, 102])
    hit_blocks, hit = manager.get_computed_blocks(replay)
    assert hit == 12
    assert [list(group) for group in hit_blocks.get_block_ids()] == [[1, 2], [N, N, 3]]
    new = manager.allocate_slots(replay, 20 - hit, hit, hit_blocks)
    assert new is not None
    assert [list(group) for group in new.get_block_ids()] == [[5, 4], [N, 6]]
    assert ids(manager, "replay") == [[1, 5, 4], [N, N, 3, N, 6]]
    assert manager.take_kv_cache_block_copies() == ([(2, 5)], [2, 5])
    manager.release_copy_retentions([2, 5])
    manager.check_invariants()


def test_the_rewind_decides_when_mamba_holds_both_states(impl: ModuleType) -> None:
    """The same model, the owner's chunks ending at 12, 16 and 17: Mamba now
    holds the states at 12 (block 3) and 16 (block 4), so the hit is full
    attention's own: matched to 16, one hash block given back, 12."""
    manager = hybrid(impl, full=8, mamba=4, hash_block_size=4)
    manager.enable_partial_hash_hits(2)
    owner = manager.make_request("owner", list(range(17)))
    run_chunks(manager, owner, [12, 16, 17])
    assert ids(manager, "owner") == [[1, 2, 5], [N, N, N, 4, 6]]
    assert keyed(manager, 3) and keyed(manager, 4)
    manager.free(owner)
    manager.new_step_starts()
    replay = manager.make_request("replay", list(range(17)) + [100, 101, 102])
    hit_blocks, hit = manager.get_computed_blocks(replay)
    assert hit == 12
    assert [list(group) for group in hit_blocks.get_block_ids()] == [[1, 2], [N, N, 3]]
    assert manager.allocate_slots(replay, 20 - hit, hit, hit_blocks) is not None
    assert ids(manager, "replay") == [[1, 6, 5], [N, N, 3, N, 7]]
    assert manager.take_kv_cache_block_copies()[0] == [(2, 6)]


def test_an_eagle_prompt_tail_is_published_at_the_whole_prompt(impl: ModuleType) -> None:
    """D-MAMBA-39: with EAGLE a 12-token prompt publishes the partial key of
    12 inside full-attention block 2 (a resend matches 12, then gives back 4);
    without EAGLE the boundary is 8, a block end, and nothing is published."""
    for use_eagle, published in ((True, True), (False, False)):
        manager = hybrid(impl, full=8, mamba=4, hash_block_size=4, use_eagle=use_eagle)
        manager.enable_partial_hash_hits(2)
        owner = manager.make_request("owner", list(range(12)))
        run_chunks(manager, owner, [8, 12])
        assert ids(manager, "owner")[0] == [1, 3]
        assert keyed(manager, 3) is published


def test_the_junction_is_a_resume_checkpoint(impl: ModuleType) -> None:
    """MPART-6 (vLLM's ``test_sibling_resumes_below_the_block_grid_...``):
    full attention 16 beside Mamba 16, hash 4, EAGLE. The owner shares 24
    tokens with its followers and then diverges. The first follower's full
    attention matches 16 and gives back 4: its junction is 12, a chunk ends
    there and the switch publishes Mamba's state at 12 inside block 1, so the
    next follower resumes at 12."""
    manager = hybrid(impl, full=16, mamba=16, hash_block_size=4, num_blocks=40)
    manager.enable_partial_hash_hits(shared_prefix_checkpoint=True)
    shared = list(range(1, 25))
    owner = manager.make_request("owner", shared + [1000] * 16)
    run_chunks(manager, owner, [16, 36, 40])
    assert ids(manager, "owner") == [[1, 3, 4], [N, N, 5]]

    follower = manager.make_request("follower", shared + [2000] * 16)
    _, hit = manager.get_computed_blocks(follower)
    assert hit == 0
    junction = manager.shared_prefix_boundary(follower, hit)
    assert junction == 12
    follower.shared_prefix_boundary = junction
    run_chunks(manager, follower, [12, 16, 36, 40])
    assert ids(manager, "follower") == [[7, 10, 11], [N, N, 12]]

    sibling = manager.make_request("sibling", shared + [3000] * 16)
    hit_blocks, hit = manager.get_computed_blocks(sibling)
    assert hit == 12
    assert [list(group) for group in hit_blocks.get_block_ids()] == [[1], [9]]


def test_without_the_switch_the_junction_publishes_nothing(impl: ModuleType) -> None:
    """The same run with the switch off: the follower's chunk ending at 12
    keys nothing, so the next follower finds no Mamba state below 16."""
    manager = hybrid(impl, full=16, mamba=16, hash_block_size=4, num_blocks=40)
    manager.enable_partial_hash_hits()
    shared = list(range(1, 25))
    run_chunks(manager, manager.make_request("owner", shared + [1000] * 16), [16, 36, 40])
    follower = manager.make_request("follower", shared + [2000] * 16)
    follower.shared_prefix_boundary = 12
    run_chunks(manager, follower, [12, 16, 36, 40])
    _, hit = manager.get_computed_blocks(manager.make_request("sibling", shared + [3000] * 16))
    assert hit == 0


def test_a_junction_past_the_prompt_publishes_nothing(impl: ModuleType) -> None:
    """The running state past the prompt changes before a sibling could read
    it: a junction there keys nothing (vLLM's ``..._falls_back_and_registers_nothing``)."""
    manager = hybrid(impl, full=16, mamba=16, hash_block_size=4, num_blocks=40)
    manager.enable_partial_hash_hits(shared_prefix_checkpoint=True)
    request = manager.make_request("r", list(range(1, 21)))
    run_chunks(manager, request, [16, 20])
    request.append_output_token_ids([7] * 8)
    request.shared_prefix_boundary = 24
    before = manager.snapshot().pool.block_hashes
    run_chunks(manager, request, [24])
    mamba = ids(manager, "r")[1]
    assert all(before[block] == manager.snapshot().pool.block_hashes[block] for block in mamba if block)
    assert manager.snapshot().pool.block_hashes[mamba[-1]] is None


@pytest.mark.parametrize("use_eagle, lookahead, reason", [
    (False, 0, "does not draft"),
    (True, 2, "re-prefilled"),
])
def test_the_resume_switch_is_refused_where_vllm_narrows_it(impl: ModuleType, use_eagle: bool, lookahead: int,
                                                            reason: str) -> None:
    """D-MAMBA-40: no drafter, or a multi-module drafter re-prefilling tokens;
    the refusal changes nothing (sub-block hits stay off too)."""
    manager = hybrid(impl, full=16, mamba=16, hash_block_size=4, use_eagle=use_eagle,
                     num_prefill_lookahead=lookahead)
    before = manager.snapshot()
    with pytest.raises(InvalidConfigError, match=reason):
        manager.enable_partial_hash_hits(shared_prefix_checkpoint=True)
    assert manager.snapshot() == before
    assert manager.coordinator.partial_hits_enabled is False
