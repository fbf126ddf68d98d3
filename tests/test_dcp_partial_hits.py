"""Decode context parallelism beside Mamba groups: full-attention sub-block
hits with copy-on-write (spec/mamba.md "DCP and full-attention sub-block
hits", FPART-1..4, D-MAMBA-20..24; spec/examples.md §16), one suite over
every implementation.

The block sizes are the effective ones a DCP model hands the manager: an
attention spec of 4 tokens per rank at DCP 2 is an 8-token block, the
replicated Mamba state keeps its 4 tokens, hashing is at 4 tokens.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.reference.features.dcp_rules import (
    context_parallel_block_size,
    partial_hits_configured_under_dcp,
    tail_boundaries,
)
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.mamba_spec import MambaSpec
from tests.implementations import IMPLEMENTATIONS

N = 0  # the null block


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    module: ModuleType = IMPLEMENTATIONS[request.param]
    return module


def dcp_hybrid(impl: ModuleType, *, hash_block_size: int = 4, full: int = 8, mamba: int = 4,
               dcp: int = 2, num_blocks: int = 20) -> Any:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(full, 1, 1, "float32")),
              KVCacheGroupSpec(("mamba",), MambaSpec(mamba, shapes=((1,),), dtypes=("float32",),
                                                     mamba_cache_mode="align")))
    manager = impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 1024, hash_block_size=hash_block_size)
    manager.enable_partial_hash_hits(dcp)
    return manager


def key_of(manager: Any, block: int) -> Any:
    return manager.snapshot().pool.block_hashes[block]


def ref_count(manager: Any, block: int) -> int:
    manager.check_invariants()
    count: int = manager.snapshot().pool.ref_counts[block]
    return count


def test_dcp_widens_the_condition_to_a_mamba_block_of_one_hash_block() -> None:
    # D-MAMBA-20: the Mamba state (4 tokens) equals the hash block; only DCP turns hits on.
    kinds, specs = ["full_attention", "mamba"], [FullAttentionSpec(4, 1, 1, "float32"),
                                                 MambaSpec(4, shapes=((1,),), dtypes=("float32",),
                                                           mamba_cache_mode="align")]
    assert [context_parallel_block_size(spec, 2) for spec in specs] == [8, 4]
    assert not partial_hits_configured_under_dcp(kinds, specs, [8, 4], 4, 1)
    assert partial_hits_configured_under_dcp(kinds, specs, [8, 4], 4, 2)
    # The tail of a 12-token hit in an 8-token block: boundaries 12 only (14 is not a hash boundary).
    assert list(tail_boundaries(12, 15, 16, 4, 8)) == [12]
    assert list(tail_boundaries(10, 15, 16, 2, 8)) == [14, 12, 10]
    assert list(tail_boundaries(16, 15, 16, 4, 8)) == []


def test_without_dcp_the_same_sizes_are_refused(impl: ModuleType) -> None:
    with pytest.raises(InvalidConfigError, match="would not enable"):
        dcp_hybrid(impl, dcp=1)
    with pytest.raises(InvalidConfigError, match="dcp_world_size"):
        dcp_hybrid(impl, dcp=0)


def test_hit_inside_a_dcp_block_is_copied_on_write(impl: ModuleType) -> None:
    manager = dcp_hybrid(impl)
    owner = manager.make_request("owner", list(range(13)))
    assert manager.allocate_slots(owner, 12) is not None
    # Full attention: block 1 (tokens 0-7) under its full key, block 2 holds
    # tokens 8-11 and carries the partial key of boundary 12 (FPART-2).
    assert manager.get_block_ids("owner") == ([1, 2], [N, N, 3]) or list(
        map(list, manager.get_block_ids("owner"))) == [[1, 2], [N, N, 3]]
    assert key_of(manager, 2) is not None and key_of(manager, 3) is not None
    manager.free(owner)
    manager.new_step_starts()

    replay = manager.make_request("replay", list(range(16)))
    hit_blocks, hit = manager.get_computed_blocks(replay)
    assert hit == 12
    assert [list(group) for group in hit_blocks.get_block_ids()] == [[1, 2], [N, N, 3]]
    new = manager.allocate_slots(replay, 4, hit, hit_blocks)
    assert new is not None
    # FPART-3: the copy's destination comes first among the new full-attention blocks.
    destination = new.get_block_ids()[0][0]
    assert destination not in (1, 2, 3)
    assert list(manager.get_block_ids("replay")[0]) == [1, destination]
    copies, retained = manager.take_kv_cache_block_copies()
    # Only the full-attention tail is copied: the Mamba state at 12 ends its block.
    assert copies == [(2, destination)]
    assert retained == [2, destination]
    assert ref_count(manager, 2) == 1 and ref_count(manager, destination) == 2
    manager.release_copy_retentions(retained)
    assert ref_count(manager, 2) == 0 and ref_count(manager, destination) == 1
    # Once full (16 tokens) the copy is cached under its own full key.
    assert key_of(manager, destination) is not None


def test_joint_hit_is_bounded_by_the_mamba_states(impl: ModuleType) -> None:
    manager = dcp_hybrid(impl)
    owner = manager.make_request("owner", list(range(13)))
    assert manager.allocate_slots(owner, 8) is not None
    manager.new_step_starts()
    replay = manager.make_request("before", list(range(16)))
    hit_blocks, hit = manager.get_computed_blocks(replay)
    # The prompt tail (12) is not reached yet: the common hit is the state at 8.
    assert hit == 8 and [len(group) for group in hit_blocks.get_block_ids()] == [1, 2]
    owner.num_computed_tokens = 8
    assert manager.allocate_slots(owner, 4) is not None
    manager.new_step_starts()
    hit_blocks, hit = manager.get_computed_blocks(manager.make_request("after", list(range(16))))
    assert hit == 12 and [len(group) for group in hit_blocks.get_block_ids()] == [2, 3]


def test_a_full_block_keeps_the_prompt_tail_as_its_extra_entry(impl: ModuleType) -> None:
    # Hash 2, full block 8 (DCP 4 of 2 tokens), Mamba 2: a 16-token prompt's
    # tail 14 lies in full block 1 (tokens 8-15). The first chunk (14 tokens)
    # publishes it as that block's key; the second fills the block, which
    # takes its full key and keeps the tail as its extra entry (D-MAMBA-22).
    manager = dcp_hybrid(impl, hash_block_size=2, full=8, mamba=2, dcp=4)
    owner = manager.make_request("owner", list(range(16)))
    assert manager.allocate_slots(owner, 14) is not None
    full_blocks = list(manager.get_block_ids("owner")[0])
    assert len(full_blocks) == 2
    partial = key_of(manager, full_blocks[1])
    owner.num_computed_tokens = 14
    manager.new_step_starts()
    assert manager.allocate_slots(owner, 2) is not None
    assert key_of(manager, full_blocks[1]) not in (None, partial)
    manager.free(owner)
    manager.new_step_starts()
    # A resend reads at most 15 tokens: block 1 is out of reach under its
    # full key, in reach through the tail 14.
    resend = manager.make_request("resend", list(range(16)))
    hit_blocks, hit = manager.get_computed_blocks(resend)
    assert hit == 14
    assert list(hit_blocks.get_block_ids()[0]) == full_blocks
    new = manager.allocate_slots(resend, 2, hit, hit_blocks)
    assert new is not None
    assert manager.take_kv_cache_block_copies()[0] == [(full_blocks[1], new.get_block_ids()[0][0])]


def test_a_filled_published_block_trades_its_partial_key(impl: ModuleType) -> None:
    manager = dcp_hybrid(impl, hash_block_size=2, full=8, mamba=2, dcp=4)
    owner = manager.make_request("owner", list(range(7)))
    assert manager.allocate_slots(owner, 6) is not None
    (block,) = manager.get_block_ids("owner")[0]
    partial = key_of(manager, block)
    assert partial is not None
    owner.num_computed_tokens = 6
    owner.append_output_token_ids([7, 8])
    assert manager.allocate_slots(owner, 2) is not None
    # Full at 8 tokens: the block now carries its full key (FPART-4) ...
    full = key_of(manager, block)
    assert full is not None and full != partial
    manager.free(owner)
    manager.new_step_starts()
    # ... and the prompt tail 6 still serves through its extra entry.
    hit_blocks, hit = manager.get_computed_blocks(manager.make_request("resend", list(range(7))))
    assert hit == 6 and list(hit_blocks.get_block_ids()[0]) == [block]
