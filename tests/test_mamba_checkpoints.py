"""Mamba prefill checkpoints (spec/mamba.md, spec/examples.md "Mamba prefill
checkpoints"), one suite over every implementation.

The worker exports a chunk's checkpoint where ``pagedkv.reference.features.mamba_checkpoint_rules``
says; the manager must have reserved a real block at that column (MCKPT-1),
and never publishes a checkpoint under a key naming another position (MCKPT-3).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.reference.features.mamba_checkpoint_rules import (
    checkpoint_column,
    checkpoint_exportable,
    checkpoint_position,
    partial_hash_hits_configured,
)
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec, SlidingWindowSpec
from pagedkv.spec.mamba_spec import MambaSpec
from tests.implementations import IMPLEMENTATIONS

N = 0  # the null block


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    module: ModuleType = IMPLEMENTATIONS[request.param]
    return module


def mamba(block_size: int = 32, *, checkpoints: bool = True, speculative: int = 0) -> MambaSpec:
    return MambaSpec(block_size, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                     num_speculative_blocks=speculative,
                     num_prefill_checkpoint_blocks=int(checkpoints),
                     prefill_checkpoint_alignment=16 if checkpoints else None)


def make(impl: ModuleType, *specs: KVCacheSpec, num_blocks: int = 40, **kwargs: Any) -> Any:
    groups = tuple(KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs))
    return impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 1024, **kwargs)


def mamba_group(manager: Any) -> Any:
    groups = [group for group in manager.coordinator.managers if hasattr(group, "checkpoints")]
    assert len(groups) == 1
    return groups[0]


def block_ids(manager: Any, request_id: str, group: int) -> list[int]:
    return list(manager.get_block_ids(request_id)[group])


def run(manager: Any, request: Any, num_tokens: int) -> None:
    assert manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens


# -- the worker's contract --------------------------------------------------------------


def test_checkpoint_position_leaves_a_token_and_eagle_drops_a_unit() -> None:
    assert checkpoint_position(64, 16, False) == 48      # token 63 recomputes the logits
    assert checkpoint_position(65, 16, False) == 64
    assert checkpoint_position(64, 16, True) == 48       # EAGLE: one unit below 64
    assert checkpoint_position(65, 16, True) == 48
    assert checkpoint_position(66, 16, False, num_hash_lookahead_tokens=2) == 64
    assert checkpoint_position(10, 16, True) == 0
    assert checkpoint_column(64, 32) == 0 and checkpoint_column(104, 32) == 2


def test_exportable_needs_a_hash_aligned_start_and_a_later_column() -> None:
    ok = dict(hash_block_size=16, block_size=32, export_alignment=16)
    assert checkpoint_exportable(query_start=0, query_end=64, position=48, **ok)
    assert not checkpoint_exportable(query_start=8, query_end=64, position=48, **ok)   # start off the grid
    assert not checkpoint_exportable(query_start=32, query_end=64, position=48, **ok)  # column 0 holds the start state
    assert not checkpoint_exportable(query_start=0, query_end=64, position=48,
                                     hash_block_size=16, block_size=32, export_alignment=None)
    assert not checkpoint_exportable(query_start=0, query_end=64, position=48,
                                     hash_block_size=16, block_size=32, export_alignment=32)


def test_partial_hash_hits_configured_follows_vllm() -> None:
    full, align = FullAttentionSpec(16, 1, 8, "float16"), mamba(32)
    window = SlidingWindowSpec(32, 1, 8, "float16", sliding_window=8)
    assert partial_hash_hits_configured(["full_attention", "mamba"], [full, align], [16, 32], 16)
    assert not partial_hash_hits_configured(["full_attention", "mamba"], [full, align], [32, 32], 32)
    assert not partial_hash_hits_configured(["sliding_window", "mamba"], [window, align], [32, 32], 16)
    assert not partial_hash_hits_configured(["mamba"], [align], [32], 16)  # one group: unitary


def test_spec_refuses_bad_checkpoint_fields() -> None:
    with pytest.raises(InvalidConfigError, match="num_prefill_checkpoint_blocks"):
        MambaSpec(32, shapes=((2,),), dtypes=("float16",), num_prefill_checkpoint_blocks=-1)
    with pytest.raises(InvalidConfigError, match="prefill_checkpoint_alignment"):
        MambaSpec(32, shapes=((2,),), dtypes=("float16",), prefill_checkpoint_alignment=0)


# -- the worked example of spec/examples.md ----------------------------------------------------


def test_worked_example_two_chunks(impl: ModuleType) -> None:
    """Full attention block 16, Mamba block 32, hash block 16: a 104-token
    prompt in chunks of 64 and 40 tokens."""
    manager = make(impl, FullAttentionSpec(16, 1, 8, "float16"), mamba(32), hash_block_size=16)
    group = mamba_group(manager)
    assert group.cache_hit_alignment_tokens == 16  # sub-block hits configured (MCKPT-4)
    request = manager.make_request("a", list(range(104)))
    free = manager.block_pool.get_num_free_blocks()
    run(manager, request, 64)
    # Chunk [0, 64): checkpoint at 48 into column 0, running state at column 1.
    assert group.checkpoints["a"] == (48, 0)
    ckpt, state = block_ids(manager, "a", 1)
    assert N not in (ckpt, state)
    assert free - manager.block_pool.get_num_free_blocks() == 4 + 2  # 4 attention + 2 state blocks
    # MCKPT-3: column 0 holds the state at 48, not at 32: never published under block 0's key.
    snapshot = manager.snapshot()
    assert snapshot.pool.block_hashes[ckpt] is None
    assert snapshot.pool.block_hashes[state] is not None  # the state at 64 is its block's end
    run(manager, request, 40)
    # Chunk [64, 104): checkpoint at 96 = the end of column 2, so it is published.
    assert group.checkpoints["a"] == (96, 2)
    blocks = block_ids(manager, "a", 1)
    assert blocks[0] == N and blocks[1] == state and N not in blocks[2:]
    assert len(blocks) == 4
    assert manager.snapshot().pool.block_hashes[blocks[2]] is not None
    # A sibling with the same prompt resumes from the checkpoint at 96.
    manager.free(request)
    manager.new_step_starts()
    sibling = manager.make_request("b", list(range(104)))
    _, hit = manager.get_computed_blocks(sibling)
    assert hit == 96


def test_no_checkpoint_without_alignment_or_in_mode_all(impl: ModuleType) -> None:
    manager = make(impl, FullAttentionSpec(16, 1, 8, "float16"), mamba(32, checkpoints=False),
                   hash_block_size=16)
    request = manager.make_request("a", list(range(104)))
    run(manager, request, 64)
    assert mamba_group(manager).checkpoints == {}
    assert block_ids(manager, "a", 1)[0] == N


def test_retention_zero_reserves_only_on_the_prefill_end_chunk(impl: ModuleType) -> None:
    manager = make(impl, FullAttentionSpec(16, 1, 8, "float16"), mamba(32), hash_block_size=16,
                   retention_interval=0)
    group = mamba_group(manager)
    request = manager.make_request("a", list(range(200)))
    run(manager, request, 64)
    assert "a" not in group.checkpoints and block_ids(manager, "a", 1)[0] == N
    run(manager, request, 136)
    assert group.checkpoints["a"] == (192, 5)


def test_refused_allocation_records_nothing(impl: ModuleType) -> None:
    # 4 attention + 2 state blocks needed, 5 free: refused, and no checkpoint recorded.
    manager = make(impl, FullAttentionSpec(16, 1, 8, "float16"), mamba(32), num_blocks=6,
                   hash_block_size=16)
    request = manager.make_request("a", list(range(104)))
    assert manager.allocate_slots(request, 64) is None
    assert mamba_group(manager).checkpoints == {}


def test_free_forgets_the_checkpoint(impl: ModuleType) -> None:
    manager = make(impl, FullAttentionSpec(16, 1, 8, "float16"), mamba(32), hash_block_size=16)
    request = manager.make_request("a", list(range(104)))
    run(manager, request, 64)
    manager.free(request)
    assert mamba_group(manager).checkpoints == {}


# -- D-MAMBA-3 (vLLM 0.33): release on the settled count, no speculative discount --------------


def test_speculative_states_released_on_the_settled_count(impl: ModuleType) -> None:
    """Mode ``all``, block 4, one speculative block: after 9 settled tokens the
    states ending at 4 and 8 are dead (only the state at 9 is read), so both
    go; the seeds' ``T - s`` rule kept the state at 8 one step longer. MAMBA-1."""
    manager = make(impl, MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="all",
                                   num_speculative_blocks=1))
    request = manager.make_request("a", list(range(12)))
    run(manager, request, 9)
    assert N not in block_ids(manager, "a", 0)[:2]
    run(manager, request, 1)
    assert block_ids(manager, "a", 0)[:2] == [N, N]
    # With the 9th token still in flight (settled 8), the state at 8 stays.
    manager = make(impl, MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="all",
                                   num_speculative_blocks=1))
    request = manager.make_request("a", list(range(12)))
    run(manager, request, 9)
    assert manager.allocate_slots(request, 1, num_in_flight_tokens=1) is not None
    assert block_ids(manager, "a", 0)[0] == N and block_ids(manager, "a", 0)[1] != N


# -- boundary-state offloads (MOFF-1) -------------------------------------------------------------


def test_boundary_states_offered_once_and_dropped_on_free(impl: ModuleType) -> None:
    """Every state an align group caches is offered once, with its block and
    token count, group by group; a freed request's pending offers go."""
    manager = make(impl, FullAttentionSpec(4, 1, 8, "float16"), mamba(4, checkpoints=False),
                   mamba(4, checkpoints=False))
    request = manager.make_request("a", list(range(10)))
    run(manager, request, 8)
    state_1 = block_ids(manager, "a", 1)[1]
    state_2 = block_ids(manager, "a", 2)[1]
    assert manager.take_boundary_state_offloads() == {"a": [(1, state_1, 8), (2, state_2, 8)]}
    run(manager, request, 1)  # 9 tokens: no new full block, nothing new to offer
    assert manager.take_boundary_state_offloads() == {}
    other = manager.make_request("b", list(range(100, 108)))
    run(manager, other, 8)
    manager.free(other)
    assert manager.take_boundary_state_offloads() == {}
