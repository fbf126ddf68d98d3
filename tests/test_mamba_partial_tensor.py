"""Copy-on-write of a Mamba sub-block hit, manager and tensor path together
(spec/mamba.md, MPART-3): the copies ``take_kv_cache_block_copies`` hands out
run through ``pagedkv.optimized.tensor.copy_blocks``, and the destination
block then holds the source's state bytes (CPU torch)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pagedkv.optimized import KVCacheManager  # noqa: E402
from pagedkv.optimized.tensor import KVCacheMemory, copy_blocks  # noqa: E402
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from pagedkv.spec.config import KVCacheTensor  # noqa: E402
from pagedkv.spec.mamba_spec import MambaSpec  # noqa: E402

NUM_BLOCKS = 20


def test_copy_on_write_moves_the_source_state_into_the_destination() -> None:
    attention = FullAttentionSpec(2, 1, 4, "float32")
    mamba = MambaSpec(4, shapes=((8,),), dtypes=("float32",), mamba_cache_mode="align")
    config = KVCacheConfig(
        NUM_BLOCKS,
        (KVCacheTensor(attention.page_size_bytes * NUM_BLOCKS, ("attn",)),
         KVCacheTensor(mamba.page_size_bytes * NUM_BLOCKS, ("ssm",))),
        (KVCacheGroupSpec(("attn",), attention), KVCacheGroupSpec(("ssm",), mamba)))
    manager = KVCacheManager(config, 1024, hash_block_size=2)
    manager.enable_partial_hash_hits()
    memory = KVCacheMemory(config, "cpu")
    (state,) = memory.layer("ssm").states

    producer = manager.make_request("0", [0, 0, 1, 1, 2, 2, 3])
    assert manager.allocate_slots(producer, 6) is not None
    source = manager.get_block_ids("0")[1][1]
    # The worker writes the state after 6 tokens into the producer's block.
    written = torch.arange(8, dtype=torch.float32) + 100.0
    state[source] = written
    manager.free(producer)
    manager.new_step_starts()

    sibling = manager.make_request("1", [0, 0, 1, 1, 2, 2, 3, 3])
    hit_blocks, hit = manager.get_computed_blocks(sibling)
    assert hit == 6
    assert manager.allocate_slots(sibling, 2, hit, hit_blocks) is not None
    destination = manager.get_block_ids("1")[1][1]
    assert destination != source
    assert not torch.equal(state[destination], written)

    copies, retained = manager.take_kv_cache_block_copies()
    assert copies == [(source, destination)]
    copy_blocks(memory, copies, group_id=1)
    assert torch.equal(state[destination], written)
    assert torch.equal(state[source], written)  # the source is read, not moved
    manager.release_copy_retentions(retained)
    manager.check_invariants()
