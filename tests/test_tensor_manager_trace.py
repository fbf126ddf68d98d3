"""The full-attention manager and the block tables driven together through a
trace, as an engine does: after every step, each running request's table row
equals ``KVCacheManager.get_block_ids`` and its slots are where the reference
puts them.

Skipped while ``pagedkv.optimized.KVCacheManager`` is not importable (it is
written in parallel with the tensor path).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv.optimized.tensor import BlockTables, token_batch  # noqa: E402
from pagedkv.reference.features.tensor_model import reference_slot_mapping  # noqa: E402
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from pagedkv.spec.kv_cache_spec import FullAttentionSpec  # noqa: E402

optimized = pytest.importorskip("pagedkv.optimized")
if not hasattr(optimized, "KVCacheManager"):
    pytest.skip("pagedkv.optimized.KVCacheManager is not available yet", allow_module_level=True)

BLOCK_SIZE = 4
NUM_BLOCKS = 48
MAX_MODEL_LEN = 64
MAX_REQS = 6


def _config() -> KVCacheConfig:
    spec = FullAttentionSpec(BLOCK_SIZE, 1, 8, "float16")
    return KVCacheConfig(NUM_BLOCKS, (KVCacheTensor(NUM_BLOCKS * spec.page_size_bytes, ("l0",)),),
                         (KVCacheGroupSpec(("l0",), spec),))


@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), num_steps=st.integers(1, 40))
def test_block_tables_follow_the_manager(seed: int, num_steps: int) -> None:
    rng = random.Random(seed)
    manager = optimized.KVCacheManager(_config(), MAX_MODEL_LEN, enable_caching=True)
    tables = BlockTables([BLOCK_SIZE], MAX_REQS, [MAX_MODEL_LEN // BLOCK_SIZE], NUM_BLOCKS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 13))] for _ in range(3)]
    row_of: dict[str, int] = {}
    requests: dict[str, object] = {}
    next_id = 0
    for _ in range(num_steps):
        if hasattr(manager, "new_step_starts"):
            manager.new_step_starts()
        scheduled: list[tuple[int, int, int]] = []  # (row, first position, count)
        # Decode one token for every running request; finish some.
        for req_id in list(row_of):
            request = requests[req_id]
            if rng.random() < 0.15 or request.num_tokens >= MAX_MODEL_LEN - 1:  # type: ignore[attr-defined]
                manager.free(request)
                tables.remove_request(row_of.pop(req_id))
                continue
            new_blocks = manager.allocate_slots(request, 1)
            if new_blocks is None:  # out of blocks: preempt
                manager.free(request)
                tables.remove_request(row_of.pop(req_id))
                continue
            tables.append_blocks(row_of[req_id], new_blocks.get_block_ids())
            scheduled.append((row_of[req_id], request.num_computed_tokens, 1))  # type: ignore[attr-defined]
        # Admit a new request, often sharing a prefix with earlier ones.
        free_rows = [r for r in range(MAX_REQS) if not tables.is_occupied(r)]
        if free_rows and rng.random() < 0.7:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            req_id = f"r{next_id}"
            next_id += 1
            request = manager.make_request(req_id, tokens)
            computed, num_computed = manager.get_computed_blocks(request)
            num_new = len(tokens) - num_computed
            if manager.allocate_slots(request, num_new, num_computed, computed) is not None:
                requests[req_id] = request
                row_of[req_id] = free_rows[0]
                tables.add_request(free_rows[0], manager.get_block_ids(req_id))
                scheduled.append((free_rows[0], num_computed, num_new))
        # The step runs: the scheduled tokens are computed, each running request samples one.
        tables.commit()
        _check_rows(manager, tables, row_of)
        _check_slots(manager, tables, row_of, scheduled)
        for row, start, count in scheduled:
            req_id = next(r for r, rw in row_of.items() if rw == row)
            request = requests[req_id]
            request.num_computed_tokens = start + count  # type: ignore[attr-defined]
            request.append_output_token_ids(rng.randrange(50))  # type: ignore[attr-defined]
        if rng.random() < 0.3:
            for src, dst in tables.condense():
                req_id = next(r for r, rw in row_of.items() if rw == src)
                row_of[req_id] = dst
            tables.commit()
            _check_rows(manager, tables, row_of)
    for req_id in list(row_of):
        manager.free(requests[req_id])
        tables.remove_request(row_of.pop(req_id))
    tables.commit()
    assert not tables.table(0).any()


def _check_rows(manager: object, tables: BlockTables, row_of: dict[str, int]) -> None:
    device_table = tables.table(0).cpu().tolist()
    for req_id, row in row_of.items():
        ids = manager.get_block_ids(req_id)[0]  # type: ignore[attr-defined]
        assert device_table[row][:len(ids)] == list(ids), (req_id, row)
        assert not any(device_table[row][len(ids):])


def _check_slots(manager: object, tables: BlockTables, row_of: dict[str, int],
                 scheduled: list[tuple[int, int, int]]) -> None:
    if not scheduled:
        return
    rows, starts, counts = (list(column) for column in zip(*scheduled))
    token_rows, positions = token_batch(torch.tensor(rows), torch.tensor(starts),
                                        torch.tensor(counts), sum(counts))
    slots = tables.slot_mapping(token_rows, positions)[0].tolist()
    table = [[0] * (MAX_MODEL_LEN // BLOCK_SIZE) for _ in range(MAX_REQS)]
    for req_id, row in row_of.items():
        ids = list(manager.get_block_ids(req_id)[0])  # type: ignore[attr-defined]
        table[row][:len(ids)] = ids
    assert slots == reference_slot_mapping(table, BLOCK_SIZE, token_rows.tolist(),
                                           positions.tolist())
