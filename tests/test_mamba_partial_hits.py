"""Sub-block (partial) prefix hits with copy-on-write for Mamba ``align``
groups (spec/mamba.md "Sub-block hits", spec/examples.md "Mamba sub-block
hit"), one suite over every implementation.

Hash block 2, full attention block 2, Mamba block 4: a prompt of 7 tokens
has its last reusable boundary at 6, inside Mamba block 1.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec, SlidingWindowSpec
from pagedkv.spec.mamba_spec import MambaSpec
from tests.implementations import IMPLEMENTATIONS

N = 0  # the null block


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    module: ModuleType = IMPLEMENTATIONS[request.param]
    return module


def make(impl: ModuleType, *specs: KVCacheSpec, num_blocks: int = 20, enable: bool = True,
         **kwargs: Any) -> Any:
    groups = tuple(KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs))
    manager = impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 1024, hash_block_size=2,
                                  **kwargs)
    if enable:
        manager.enable_partial_hash_hits()
    return manager


def hybrid(impl: ModuleType, **kwargs: Any) -> Any:
    return make(impl, FullAttentionSpec(2, 1, 1, "float32"),
                MambaSpec(4, shapes=((1,),), dtypes=("float32",), mamba_cache_mode="align"), **kwargs)


def ref_count(manager: Any, block: int) -> int:
    manager.check_invariants()
    count: int = manager.snapshot().pool.ref_counts[block]
    return count


def key_of(manager: Any, block: int) -> Any:
    return manager.snapshot().pool.block_hashes[block]


def test_finished_producer_serves_a_sub_block_hit_through_a_copy(impl: ModuleType) -> None:
    manager = hybrid(impl)
    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    # The running state after 6 tokens sits in Mamba column 1 under the partial key of 6.
    source = manager.get_block_ids("0")[1][1]
    assert key_of(manager, source) is not None
    manager.free(producer)
    manager.new_step_starts()

    sibling = manager.make_request("1", [0, 0, 1, 1, 2, 2, 3, 3])
    hit_blocks, hit = manager.get_computed_blocks(sibling)
    assert hit == 6
    assert [len(group) for group in hit_blocks.get_block_ids()] == [3, 2]
    new = manager.allocate_slots(sibling, 2, hit, hit_blocks)
    assert new is not None
    (destination,) = new.get_block_ids()[1]
    assert destination != source
    assert manager.get_block_ids("1")[1] == (N, destination) or list(manager.get_block_ids("1")[1]) == [N, destination]
    # MPART-3: the copy is queued; source and destination each hold a retention.
    copies, retained = manager.take_kv_cache_block_copies()
    assert copies == [(source, destination)]
    assert retained == [source, destination]
    assert ref_count(manager, source) == 1          # retention only (the hit moved to the copy)
    assert ref_count(manager, destination) == 2     # the request + the retention
    assert key_of(manager, source) is not None      # still published for other siblings
    assert manager.take_kv_cache_block_copies() == ([], [])
    manager.release_copy_retentions(retained)
    assert ref_count(manager, source) == 0 and ref_count(manager, destination) == 1
    # Once the copy is full (8 tokens) it is cached under its full key.
    assert key_of(manager, destination) is not None


def test_running_producer_moves_its_key_to_the_copy(impl: ModuleType) -> None:
    manager = hybrid(impl)
    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    source = manager.get_block_ids("0")[1][1]
    published = key_of(manager, source)
    producer.num_computed_tokens = 6
    producer.append_output_token_ids([3])
    assert manager.allocate_slots(producer, 1) is not None
    (source_id, copy_id), = manager.take_kv_cache_block_copies()[0]
    assert source_id == source
    # MPART-4: the producer keeps writing its own block; the key now names the copy.
    assert manager.get_block_ids("0")[1][1] == source
    assert key_of(manager, copy_id) == published
    assert key_of(manager, source) is None   # published once: never re-keyed while written
    assert ref_count(manager, copy_id) == 1 and ref_count(manager, source) == 2
    # Not a hit in the step that fills it.
    sibling = manager.make_request("1", [0, 0, 1, 1, 2, 2, 3, 3])
    hit_blocks, hit = manager.get_computed_blocks(sibling)
    assert hit == 6
    assert manager.allocate_slots(sibling, 2, hit, hit_blocks) is None
    with pytest.raises(InvalidArgumentError, match="block_ids"):
        manager.release_copy_retentions([source_id, source_id])   # retained once: refused
    manager.release_copy_retentions([source_id, copy_id])
    manager.check_invariants()
    manager.new_step_starts()
    hit_blocks, hit = manager.get_computed_blocks(sibling)
    assert hit == 6 and hit_blocks.get_block_ids()[1][1] == copy_id


def test_off_by_default_and_refused_where_unsupported(impl: ModuleType) -> None:
    manager = hybrid(impl, enable=False)
    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    assert key_of(manager, manager.get_block_ids("0")[1][1]) is None
    with pytest.raises(InvalidConfigError, match="already known"):
        manager.enable_partial_hash_hits()
    with pytest.raises(InvalidConfigError, match="sub-block"):
        make(impl, SlidingWindowSpec(2, 1, 1, "float32", sliding_window=8),
             FullAttentionSpec(2, 1, 1, "float32"),
             MambaSpec(4, shapes=((1,),), dtypes=("float32",), mamba_cache_mode="align"))
    # EAGLE no longer refuses them (D-MAMBA-36).
    assert hybrid(impl, use_eagle=True) is not None
