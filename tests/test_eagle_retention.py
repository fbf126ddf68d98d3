"""Mamba sparse retention (spec/mamba.md MRET-1, D-MAMBA-35) with EAGLE/MTP,
lookahead hashing and the shared-prefix junction, with concrete block ids.
One suite over every implementation."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.reference.features.mamba_checkpoint_rules import mamba_retention_mask
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvariantViolation
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.types import make_block_hash_with_group_id
from tests.eagle_checks import check_mamba_retention
from tests.test_gates import Surgery

N = 0  # the null block


def make(impl: ModuleType, block_size: int = 32, *, num_speculative_blocks: int = 0,
         **kwargs: Any) -> Any:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size, 1, 8, "float16")),
              KVCacheGroupSpec(("mamba",), MambaSpec(block_size, shapes=((2,),), dtypes=("float32",),
                                                     mamba_cache_mode="align",
                                                     num_speculative_blocks=num_speculative_blocks)))
    return impl.KVCacheManager(KVCacheConfig(100, (), groups), max_model_len=1024,
                               enable_caching=True, **kwargs)


def keyed_states(manager: Any, request: Any) -> list[int]:
    """Indexes ``i`` of the request's hashes whose Mamba key (group 1) is cached."""
    cached = dict(manager.snapshot().pool.cached)
    return [index for index, block_hash in enumerate(request.block_hashes)
            if make_block_hash_with_group_id(block_hash, 1) in cached]


def prefill(manager: Any, request: Any, ends: list[int], **kwargs: Any) -> None:
    for end in ends:
        assert manager.allocate_slots(request, end - request.num_computed_tokens, **kwargs) is not None
        request.num_computed_tokens = end


def test_mamba_retention_mask_rule() -> None:
    # Dense: everything.
    assert mamba_retention_mask(0, 8, 4, 4, None, (31,)) is None
    # 0: only the state at the replay position 31 floored to 28: block 6.
    assert mamba_retention_mask(0, 8, 4, 4, 0, (31,)) == [i == 6 for i in range(8)]
    # 16-token segments: blocks 3 and 7, plus the replay block 6.
    assert mamba_retention_mask(0, 8, 4, 4, 16, (31,)) == [i in (3, 6, 7) for i in range(8)]
    # A segment of one block keeps every block.
    assert mamba_retention_mask(2, 8, 4, 4, 4, ()) is None
    # Offsets: blocks [4, 8) under 16-token segments: only block 7.
    assert mamba_retention_mask(4, 8, 4, 4, 16, ()) == [False, False, False, True]


def test_mtp_resend_of_an_aligned_prompt_keeps_both_replay_states(impl: ModuleType) -> None:
    """Retention 0, EAGLE, 3 speculative Mamba blocks, 128 tokens prefilled in
    32-token chunks: the replay positions are 64 and 96, so Mamba states 1 and
    2 are keyed, 0 and 3 are not. A resend hits 96: full attention reads block
    3 past the cap and gives it back (D-SWA-15); Mamba serves state 2."""
    manager = make(impl, retention_interval=0, use_eagle=True, num_speculative_blocks=3)
    tokens = [i // 32 for i in range(128)]
    owner = manager.make_request("0", tokens)
    prefill(manager, owner, [32, 64, 96, 128], num_lookahead_tokens=3)
    assert keyed_states(manager, owner) == [1, 2]
    # Chunk by chunk (3 lookahead slots each): full blocks 1, 2, Mamba's
    # state and draft blocks 3-6, full 7, ... State 0 (block 3) is unkeyed,
    # so once released it is reused first: full block 3 of the last chunk.
    assert manager.get_block_ids("0")[0] == [1, 2, 7, 3, 10]
    manager.free(owner)
    blocks, num_hit = manager.get_computed_blocks(manager.make_request("1", tokens))
    assert num_hit == 96
    assert blocks.get_block_ids() == ([1, 2, 7], [N, N, 5])
    longer = manager.make_request("2", tokens + [9] * 32)
    assert manager.get_computed_blocks(longer)[1] == 96


def test_lookahead_hashing_keeps_the_last_prompt_boundary(impl: ModuleType) -> None:
    """Retention 0, no EAGLE, lookahead hashing of one token, 129 tokens: the
    replay position 128 keeps state 3 only; a resend hits 128."""
    manager = make(impl, retention_interval=0, num_speculative_blocks=1, num_hash_lookahead_tokens=1)
    tokens = [i // 32 for i in range(128)] + [4]
    owner = manager.make_request("0", tokens)
    prefill(manager, owner, [32, 64, 96, 128, 129], num_lookahead_tokens=1)
    assert keyed_states(manager, owner) == [3]
    manager.free(owner)
    assert manager.get_computed_blocks(manager.make_request("1", tokens))[1] == 128


@pytest.mark.parametrize("retention,pin,expected", [(None, False, 32), (0, False, 0), (0, True, 32)])
def test_shared_prefix_junction_state_is_kept_only_when_pinned(
        impl: ModuleType, retention: int | None, pin: bool, expected: int) -> None:
    """Block 16, a 32-token shared prefix. Request 0 caches full attention
    densely; request 1 hits 0 (Mamba lags) with junction 32 and prefills up
    to it. Under retention 0 its state at 32 (block index 1) is keyed only
    when the junction is pinned on it, so request 2 hits 32 only then; dense
    retention keeps it anyway."""
    manager = make(impl, 16, retention_interval=retention)
    shared = [7] * 32
    first = manager.make_request("0", shared + [50] * 32)
    assert manager.allocate_slots(first, 64) is not None
    second = manager.make_request("1", shared + [60] * 32)
    _, num_hit = manager.get_computed_blocks(second)
    junction = manager.shared_prefix_boundary(second, num_hit)
    assert (num_hit, junction) == (0, 32)
    if pin:
        second.shared_prefix_boundary = junction
    assert manager.allocate_slots(second, 32) is not None
    assert (1 in keyed_states(manager, second)) == (expected == 32)
    third = manager.make_request("2", shared + [70] * 32)
    assert manager.get_computed_blocks(third)[1] == expected


def test_sub_block_hits_with_eagle_resume_below_the_proof_boundary(impl: ModuleType) -> None:
    """D-MAMBA-36: full attention at the hash block 2, Mamba 4 (align), EAGLE,
    sub-block hits on. A 9-token prompt prefilled to 6 then 9 publishes its
    state at 6 (the prompt tail one hash block below 8) under a partial key.
    A longer sibling: full attention reads blocks 0-3 (to 8) and gives block
    3 back, Mamba resumes from the tail state at 6: the hit is 6, not the
    block boundary 4."""
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(2, 1, 8, "float16")),
              KVCacheGroupSpec(("mamba",), MambaSpec(4, shapes=((2,),), dtypes=("float32",),
                                                     mamba_cache_mode="align")))
    manager = impl.KVCacheManager(KVCacheConfig(32, (), groups), max_model_len=64, enable_caching=True,
                                  use_eagle=True, hash_block_size=2)
    manager.enable_partial_hash_hits()
    owner = manager.make_request("0", [7] * 9)
    prefill(manager, owner, [6])
    manager.new_step_starts()
    assert manager.get_block_ids("0")[1][1] == 4  # the running state, keyed at 6
    prefill(manager, owner, [9])
    manager.new_step_starts()
    # The producer wrote on, so its next step copied the state at 6 into
    # block 7 and the partial key moved there (MPART-4).
    blocks, num_hit = manager.get_computed_blocks(manager.make_request("1", [7] * 9 + [9] * 4))
    assert num_hit == 6
    assert blocks.get_block_ids() == ([1, 2, 3], [N, 7])


def test_sub_block_hits_keep_an_eagle_groups_unaligned_tail(impl: ModuleType) -> None:
    """D-MAMBA-36: full attention at the hash block 2 (every group drafting),
    Mamba 8, sub-block hits on, 22 tokens in one call. The EAGLE caching
    extent is floored to the hash block, not to the alignment 8, so the full
    group keys all 11 blocks (flooring to 8 would stop at 16 + 2 = 18 tokens,
    9 blocks)."""
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(2, 1, 8, "float16")),
              KVCacheGroupSpec(("mamba",), MambaSpec(8, shapes=((2,),), dtypes=("float32",),
                                                     mamba_cache_mode="align")))
    manager = impl.KVCacheManager(KVCacheConfig(40, (), groups), max_model_len=64, enable_caching=True,
                                  use_eagle=True, hash_block_size=2)
    manager.enable_partial_hash_hits()
    request = manager.make_request("0", list(range(22)))
    assert manager.allocate_slots(request, 22) is not None
    hashes = manager.snapshot().pool.block_hashes
    assert [block for block in manager.get_block_ids("0")[0] if hashes[block] is not None] == list(range(1, 12))


def test_mret1_gate_names_the_broken_invariant(impl: ModuleType) -> None:
    """MRET-1's gate: the lockstep post-condition passes on an honest
    retention-0 prefill and fails, naming MRET-1, once the running state block
    (position 3, not a replay position) is keyed under the request's own key."""
    manager = make(impl, retention_interval=0, use_eagle=True)
    tokens = [i // 32 for i in range(128)]
    owner = manager.make_request("a", tokens)
    before = manager.snapshot()
    prefill(manager, owner, [32, 64, 96, 128])
    options = {"retention_interval": 0, "use_eagle": True}
    check_mamba_retention(manager, owner, before, options)  # the honest state passes
    surgery = Surgery(manager)
    running = surgery.ids(1)[3]
    surgery.set_key(running, owner.block_hashes[3], 1)
    with pytest.raises(InvariantViolation, match="^MRET-1:"):
        check_mamba_retention(manager, owner, before, options)
