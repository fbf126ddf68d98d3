"""Which Mamba states get keys and which are handed to a connector
(spec/mamba.md "Caching and publication": KEYTOK-1, MRET-1, MCKPT-5,
MOFF-2, MTAIL-1; spec/examples.md "Mamba checkpoint publication"), one
suite over every implementation (the ``impl`` fixture of tests/conftest.py),
with the block ids a fresh pool hands out.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.reference.features.mamba_checkpoint_rules import (
    checkpoint_published,
    mamba_kept_boundaries,
    mamba_retention_mask,
)
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.mamba_spec import MambaSpec

N = 0  # the null block


def make(impl: ModuleType, *specs: KVCacheSpec, hash_block_size: int, partial: bool,
         num_blocks: int = 40, **kwargs: Any) -> Any:
    groups = tuple(KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs))
    manager = impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 1024,
                                  hash_block_size=hash_block_size, **kwargs)
    if partial:
        manager.enable_partial_hash_hits()
    return manager


def checkpointed(impl: ModuleType, **kwargs: Any) -> Any:
    """Full attention block 16 + Mamba block 32 with checkpoints, hash block 16."""
    mamba = MambaSpec(32, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                      num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16)
    return make(impl, FullAttentionSpec(16, 1, 8, "float16"), mamba, hash_block_size=16, **kwargs)


def key_tokens(manager: Any, block: int) -> int | None:
    manager.check_invariants()
    tokens: int | None = manager.block_pool.key_tokens(block)
    return tokens


def mamba_ids(manager: Any, request_id: str) -> list[int]:
    return list(manager.get_block_ids(request_id)[1])


# -- the shared rules ------------------------------------------------------------------------


def test_retention_mask_keeps_segment_ends_and_boundaries() -> None:
    assert mamba_retention_mask(0, 8, 32, 16, None, ()) is None                   # dense
    assert mamba_retention_mask(0, 8, 32, 16, 32, ()) is None                     # one block a segment
    assert mamba_retention_mask(0, 8, 32, 16, 64, ()) == [False, True] * 4         # ends on 64, 128, ...
    assert mamba_retention_mask(2, 8, 32, 16, 0, (239,)) == [False] * 4 + [True, False]  # 224 -> block 6
    assert mamba_retention_mask(0, 4, 32, 16, 0, (239,)) == [False] * 4            # out of range
    assert mamba_kept_boundaries(240, 0, 32, False) == (239,)
    assert mamba_kept_boundaries(240, 96, 32, True) == (192, 96)                  # EAGLE: one unit below


def test_checkpoint_published_rules() -> None:
    rule: dict[str, Any] = dict(num_prompt_tokens=240, alignment=16, drop_eagle_block=False,
                                num_hash_lookahead_tokens=0, block_size=32, shared_prefix_boundary=0,
                                partial_keys=True)
    assert checkpoint_published(position=224, retention_interval=0, **rule)       # the prompt's boundary
    assert not checkpoint_published(position=112, retention_interval=None, **rule)  # inside a block: transient
    assert checkpoint_published(position=96, retention_interval=None, **rule)     # a kept block end
    assert not checkpoint_published(position=96, retention_interval=64, **rule)   # 96 is no multiple of 64
    assert checkpoint_published(position=128, retention_interval=64, **rule)
    assert not checkpoint_published(position=96, retention_interval=0, **rule)
    assert checkpoint_published(position=96, retention_interval=0, **{**rule, "shared_prefix_boundary": 96})
    # Inside its block, the prompt's boundary needs a partial key (D-MAMBA-26).
    assert checkpoint_published(position=112, retention_interval=0, **{**rule, "num_prompt_tokens": 120})
    assert not checkpoint_published(position=112, retention_interval=0,
                                    **{**rule, "num_prompt_tokens": 120, "partial_keys": False})


# -- scenarios -------------------------------------------------------------------------------


def test_internal_prompt_checkpoint_gets_a_partial_key(impl: ModuleType) -> None:
    """120 tokens in one chunk: the checkpoint at 112 lands in column 2 (tokens
    64..96), keyed at 112, not at 96; the running state at column 3 has no key."""
    manager = checkpointed(impl, partial=True)
    request = manager.make_request("a", list(range(120)))
    assert manager.allocate_slots(request, 120) is not None
    assert list(manager.get_block_ids("a")[0]) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert mamba_ids(manager, "a") == [N, N, 9, 10]
    assert key_tokens(manager, 9) == 112                          # MCKPT-5, KEYTOK-1
    assert key_tokens(manager, 10) is None
    assert key_tokens(manager, 3) == 48                           # a full-attention key: (i + 1) * b
    assert manager.take_boundary_state_offloads() == {"a": [(1, 9, 112)]}
    manager.free(request)
    manager.new_step_starts()
    sibling = manager.make_request("b", list(range(120)))
    hit_blocks, hit = manager.get_computed_blocks(sibling)
    assert hit == 112
    assert list(hit_blocks.get_block_ids()[1]) == [N, N, N, 9]


def test_dense_retention_drops_the_transient_mid_prompt_checkpoint(impl: ModuleType) -> None:
    """240 tokens in chunks of 128 and 112, retention dense: the first chunk's
    checkpoint (112, column 2) is transient, the state at 128 is kept; the
    second chunk's checkpoint (224, column 6) is the prompt's own boundary."""
    manager = checkpointed(impl, partial=True)
    request = manager.make_request("a", list(range(240)))
    assert manager.allocate_slots(request, 128) is not None
    assert mamba_ids(manager, "a") == [N, N, 9, 10]
    assert key_tokens(manager, 9) is None                          # 112: overwritten next step
    assert key_tokens(manager, 10) == 128
    assert manager.take_boundary_state_offloads() == {"a": [(1, 10, 128)]}
    request.num_computed_tokens = 128
    manager.new_step_starts()
    assert manager.allocate_slots(request, 112) is not None
    assert mamba_ids(manager, "a") == [N, N, N, 10, N, N, 17, 18]   # column 2 released
    assert key_tokens(manager, 10) == 128 and key_tokens(manager, 17) == 224
    assert manager.take_boundary_state_offloads() == {"a": [(1, 17, 224)]}


def test_zero_retention_keeps_only_the_prompt_boundary(impl: ModuleType) -> None:
    """Same prompt under retention 0: no checkpoint on the first chunk, no
    state kept at 128; the prefill-end checkpoint at 224 is kept (MRET-1)."""
    manager = checkpointed(impl, partial=True, retention_interval=0)
    request = manager.make_request("a", list(range(240)))
    assert manager.allocate_slots(request, 128) is not None
    assert mamba_ids(manager, "a") == [N, N, N, 9]
    assert key_tokens(manager, 9) is None
    assert manager.take_boundary_state_offloads() == {}
    request.num_computed_tokens = 128
    manager.new_step_starts()
    assert manager.allocate_slots(request, 112) is not None
    assert mamba_ids(manager, "a") == [N, N, N, 9, N, N, 17, 18]
    assert key_tokens(manager, 9) is None and key_tokens(manager, 17) == 224
    assert manager.take_boundary_state_offloads() == {"a": [(1, 17, 224)]}


def hybrid(impl: ModuleType) -> Any:
    """Full attention block 2 + Mamba block 4 (align), hash block 2, sub-block hits on."""
    mamba = MambaSpec(4, shapes=((1,),), dtypes=("float32",), mamba_cache_mode="align")
    return make(impl, FullAttentionSpec(2, 1, 1, "float32"), mamba, hash_block_size=2, partial=True,
                num_blocks=20)


def test_finished_producer_hands_its_tail_over_once(impl: ModuleType) -> None:
    """MTAIL-1: a producer publishing its tail at 6 (Mamba column 1, block 4):
    a finalize off the boundary consumes the record, so nothing is handed later."""
    manager = hybrid(impl)
    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    assert mamba_ids(manager, "0") == [N, 4]
    assert key_tokens(manager, 4) == 6
    assert manager.finalize_partial_tail_offloads("0", 5, 0) == []   # not at the boundary: consumed
    assert manager.finalize_partial_tail_offloads("0", 6, 0) == []


def test_finalize_gives_the_block_when_nothing_ran_past_it(impl: ModuleType) -> None:
    manager = hybrid(impl)
    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    assert manager.finalize_partial_tail_offloads("0", 6, 1) == []   # a token in flight
    producer2 = manager.make_request("1", [5, 5, 6, 6, 7, 7, 8])
    assert manager.allocate_slots(producer2, 6) is not None
    assert mamba_ids(manager, "1") == [N, 8]
    assert manager.finalize_partial_tail_offloads("1", 6, 0) == [(1, 8, 6)]
    assert manager.finalize_partial_tail_offloads("1", 6, 0) == []   # once
    with pytest.raises(InvalidArgumentError, match="num_computed_tokens"):
        manager.finalize_partial_tail_offloads("1", -1, 0)


def test_running_producer_offers_its_copy(impl: ModuleType) -> None:
    """The producer writes on: the copy (block 6) keeps the state at 6 and is
    offered with that boundary (MOFF-2); nothing is left to finalize."""
    manager = hybrid(impl)
    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    assert manager.take_boundary_state_offloads() == {}               # a partial key: no offer yet
    producer.num_computed_tokens = 6
    producer.append_output_token_ids([3])
    assert manager.allocate_slots(producer, 1) is not None
    (pair,), _ = manager.take_kv_cache_block_copies()
    assert pair == (4, 6)
    assert key_tokens(manager, 6) == 6 and key_tokens(manager, 4) is None   # the key moved (MPART-4)
    assert manager.take_boundary_state_offloads() == {"0": [(1, 6, 6)]}
    assert manager.finalize_partial_tail_offloads("0", 7, 0) == []
