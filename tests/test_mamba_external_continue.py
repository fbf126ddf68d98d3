"""A request admitted with external (connector) tokens whose Mamba blocks it
already holds is a running request from its first allocation (D-API-45, as
vLLM 0.33's ``_allocated_block_reqs``): when it publishes its prompt tail
inside a block, its continuation keeps writing its own block and the key
moves to the copy (MPART-4), rather than taking a hit's copy-on-write.

Full attention (block 2) + Mamba ``align`` (block 8), hash block 2, 32 blocks,
sub-block hits on; a 15-token prompt, 10 tokens from a connector."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.mamba_spec import MambaSpec

N = 0


def manager_of(impl: ModuleType) -> Any:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(2, 1, 8, "float16")),
              KVCacheGroupSpec(("mamba",), MambaSpec(8, shapes=((2,),), dtypes=("float16",),
                                                     mamba_cache_mode="align")))
    manager = impl.KVCacheManager(KVCacheConfig(32, (), groups), 8192, hash_block_size=2)
    manager.enable_partial_hash_hits()
    return manager


def test_the_continuation_copies_its_published_tail_and_keeps_its_block(impl: ModuleType) -> None:
    manager = manager_of(impl)
    request = manager.make_request("0", [0] * 15)
    # The load: full blocks 1..5 for tokens 0..9, the Mamba state block 6 (position 1).
    assert manager.allocate_slots(request, 0, 0, None, 0, 10, delay_cache_blocks=True) is not None
    request.num_computed_tokens = 10
    # Tokens 10..13: the Mamba group needs no block; the prompt's last boundary,
    # 14, is published on block 6 under its partial key.
    assert manager.allocate_slots(request, 4).get_block_ids() == ([7, 8], [])
    assert manager.get_block_ids("0") == ([1, 2, 3, 4, 5, 7, 8], [N, 6])
    request.num_computed_tokens = 14
    new = manager.allocate_slots(request, 1)
    # A running producer: no new Mamba block in its table; block 10 receives the copy.
    assert new.get_block_ids() == ([9], [])
    assert manager.get_block_ids("0") == ([1, 2, 3, 4, 5, 7, 8, 9], [N, 6])
    pairs, retained = manager.take_kv_cache_block_copies()
    assert (pairs, retained) == ([(6, 10)], [6, 10])
    hashes = manager.snapshot().pool.block_hashes
    assert hashes[6] is None and hashes[10] is not None  # the key moved to the copy
    manager.release_copy_retentions(retained)
    manager.check_invariants()
