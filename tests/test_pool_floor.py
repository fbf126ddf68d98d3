"""``bench.pool_floor``'s bare replay does the same pool work as the manager.

The floor it reports is only a bound on *this* workload if the bare calls of
the C loops change the pool exactly as ``KVCacheManager`` does: same hits,
same ref counts, keys, maps and free-queue order after every request.
"""

from __future__ import annotations

import random

import pytest

from bench import pool_floor, side_driver
from bench.vllm_side_by_side import pagedkv_manager
from pagedkv.optimized.native import NATIVE


@pytest.mark.skipif(NATIVE is None, reason="built without the C modules")
@pytest.mark.parametrize("seed", range(3))
def test_bare_calls_leave_the_pool_as_the_manager_does(seed: int) -> None:
    rng = random.Random(seed)
    block_size = 4
    shared = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    prompts = [rng.choice(shared) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(30)]
    num_blocks = sum(-(-len(p) // block_size) for p in prompts) + 2
    managers = [pagedkv_manager("llama3", num_blocks, block_size, 64, "sha256") for _ in range(2)]
    real, bare = managers
    sides = [(real.get_computed_blocks, real.allocate_slots, real.free), pool_floor.bare_calls(bare, block_size)]
    for index, prompt in enumerate(prompts):
        hits = []
        for manager, calls in zip(managers, sides):
            replay = side_driver.replay_one_at_a_time([prompt], block_size, manager.make_request, *calls)
            hits.append(replay["hits"])
        assert hits[0] == hits[1], index
        assert real.block_pool.snapshot() == bare.block_pool.snapshot(), index
        assert real.block_pool.free_queue_ids() == bare.block_pool.free_queue_ids(), index
    assert any(hit for hit in hits[0])  # the prompts do share prefixes
