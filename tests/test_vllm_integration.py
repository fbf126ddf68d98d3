"""pagedkv.vllm: the vLLM 0.33 integration.

The config translation is tested everywhere (it needs no vLLM: vLLM's spec
objects are matched by class name). The adapter itself is tested where
vLLM 0.33 is importable and skipped cleanly elsewhere; ``make verify-vllm``
runs vLLM's own ``tests/v1/core`` against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pagedkv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from pagedkv.vllm.config import UnsupportedVllmSpecError, translate_config, translate_spec


@dataclass
class FakeSpec:
    block_size: int
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: Any = "torch.bfloat16"
    sliding_window: int | None = None


class SlidingWindowSpecFake(FakeSpec):
    pass


SlidingWindowSpecFake.__name__ = "SlidingWindowSpec"
FullAttentionFake = type("FullAttentionSpec", (FakeSpec,), {})
HiSparseFake = type("HiSparseResidentSpec", (FakeSpec,), {})


@dataclass
class MambaFake:
    block_size: int
    shapes: Any
    dtypes: Any
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 1
    mamba_type: str = "mamba2"


MambaFake.__name__ = "MambaSpec"


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class Config:
    num_blocks: int
    kv_cache_groups: list[Group]
    kv_cache_tensors: tuple[()] = ()


def test_translation_keeps_the_geometry() -> None:
    config = translate_config(Config(64, [
        Group(["a"], FullAttentionFake(16)),
        Group(["b"], SlidingWindowSpecFake(16, sliding_window=128)),
        Group(["c"], MambaFake(32, shapes=(1, 1), dtypes=("torch.float32",))),
    ]))
    full, window, mamba = (group.kv_cache_spec for group in config.kv_cache_groups)
    assert config.num_blocks == 64 and config.kv_cache_tensors == ()
    assert isinstance(full, FullAttentionSpec) and full.block_size == 16 and full.dtype == "bfloat16"
    assert isinstance(window, SlidingWindowSpec) and window.sliding_window == 128
    # vLLM accepts one bare shape; pagedkv's spec holds a tuple of shapes.
    assert isinstance(mamba, MambaSpec) and mamba.shapes == ((1, 1),)
    assert (mamba.mamba_cache_mode, mamba.num_speculative_blocks) == ("align", 1)


def test_unknown_dtype_maps_to_float16_and_unknown_kinds_are_refused() -> None:
    spec = translate_spec(FullAttentionFake(16, dtype="torch.float8_e4m3fn"))
    assert isinstance(spec, FullAttentionSpec) and spec.dtype == "float16"
    with pytest.raises(UnsupportedVllmSpecError, match="HiSparseResidentSpec"):
        translate_spec(HiSparseFake(16))


# ------------------------------------------------------- with vLLM installed

def _vllm() -> Any:
    return pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make verify-vllm)")


def _make(num_blocks: int = 11, block_size: int = 16, **kwargs: Any) -> tuple[Any, Any, Any]:
    _vllm()
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VFull
    from vllm.v1.kv_cache_interface import KVCacheConfig as VConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VGroup
    from vllm.v1.request import Request as VRequest

    import pagedkv.vllm

    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    config = VConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        VGroup(["l0"], VFull(block_size=block_size, num_kv_heads=1, head_size=8,
                             dtype=torch.float16))])
    manager = pagedkv.vllm.KVCacheManager(config, 1024, scheduler_block_size=block_size,
                                          hash_block_size=block_size, **kwargs)

    def make_request(request_id: str, tokens: list[int]) -> Any:
        return VRequest(request_id, tokens, sampling_params=SamplingParams(max_tokens=4),
                        pooling_params=None, block_hasher=hasher)
    return manager, make_request, pagedkv.vllm


def test_hit_allocate_free_return_vllm_types() -> None:
    manager, make_request, _ = _make()
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    first = make_request("a", list(range(40)))
    blocks, hit, boundary = manager.get_computed_blocks(first)
    assert (hit, boundary) == (0, 0)
    new = manager.allocate_slots(first, 40)
    assert isinstance(new, KVCacheBlocks) and new.get_block_ids() == ([1, 2, 3],)
    assert [b.ref_cnt for b in new.blocks[0]] == [1, 1, 1]
    assert new.blocks[0][0].block_hash is not None and new.blocks[0][2].block_hash is None
    first.num_computed_tokens = 40
    manager.free(first)
    second = make_request("b", list(range(40)))
    blocks, hit, _ = manager.get_computed_blocks(second)
    assert hit == 32 and blocks.get_block_ids() == ([1, 2],)


def test_unknown_requests_answer_as_vllm() -> None:
    """D-VLLM-2: empty answers and a no-op free after the request is gone."""
    manager, make_request, _ = _make()
    request = make_request("a", list(range(20)))
    assert manager.get_block_ids("a") == ([],)
    assert manager.get_blocks("a").get_block_ids() == ([],)
    manager.free(request)
    manager.allocate_slots(request, 20)
    manager.free(request)
    assert manager.get_block_ids("a") == ([],) and manager.estimate_cached_tokens(request) == 0


def test_deferred_free_pins_until_the_engine_frees() -> None:
    """D-VLLM-3: pop_blocks_for_free keeps the blocks out of the free queue."""
    manager, make_request, _ = _make()
    request = make_request("a", list(range(40)))
    manager.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    free_before = manager.block_pool.get_num_free_blocks()
    blocks = manager.pop_blocks_for_free(request)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert manager.get_block_ids("a") == ([],)
    assert manager.block_pool.get_num_free_blocks() == free_before
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    manager.block_pool.free_blocks(reversed(blocks))
    assert manager.block_pool.get_num_free_blocks() == free_before + 3
    # The partial block (unhashed) goes to the front, the hashed ones to the back.
    queue = manager.block_pool.free_block_queue.get_all_free_blocks()
    assert queue[0].block_id == 3 and [b.block_id for b in queue[-2:]] == [2, 1]


def test_watermark_keeps_headroom_for_waiting_requests() -> None:
    """D-VLLM-4: a waiting request is refused when it would eat into the watermark."""
    manager, make_request, _ = _make(num_blocks=11, watermark=0.3)  # 3 blocks of headroom
    request = make_request("a", list(range(16 * 8)))
    assert manager.allocate_slots(request, 16 * 8) is None  # 8 + 3 > 10 free
    assert manager.allocate_slots(request, 16 * 8, has_scheduled_reqs=False) is not None


@pytest.mark.parametrize("caching", [True, False])  # the core's admission step, the general path
def test_watermark_and_reserved_blocks_pass_separately(caching: bool) -> None:
    """D-API-48: vLLM's two gates through the adapter, block ids as stock vLLM 0.33
    gives them (10 usable blocks, a 128-token request needing 8, a 16-token chunk):
    reserved_blocks keeps the chunk's gate only, the watermark both."""
    cases = [  # (watermark, reserved_blocks, has_scheduled_reqs, new block ids)
        (0.0, 4, True, [1]),  # vLLM's test_full_sequence_admission_..._immediate_chunk[4-True]
        (0.0, 10, True, None),  # ... [10-False]
        (0.2, 4, True, [1]),  # whole 8 + 2 <= 10, chunk 1 + 4 + 2 <= 10
        (0.2, 9, True, None),  # chunk 1 + 9 + 2 > 10
        (0.3, 0, True, None),  # whole 8 + 3 > 10
        (0.3, 0, False, [1]),  # nothing else scheduled: no watermark
    ]
    for watermark, reserved, scheduled, expected in cases:
        manager, make_request, _ = _make(num_blocks=11, watermark=watermark, enable_caching=caching)
        blocks = manager.allocate_slots(make_request("chunk", list(range(128))), 16,
                                        full_sequence_must_fit=True, reserved_blocks=reserved,
                                        has_scheduled_reqs=scheduled)
        got = None if blocks is None else blocks.get_block_ids()
        assert got == (None if expected is None else ([*expected],)), (watermark, reserved, scheduled)


def test_scheduler_builds_the_pagedkv_manager() -> None:
    _, _, module = _make()
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    assert issubclass(module.Scheduler, VllmScheduler)
    from vllm.v1.core.sched import scheduler as scheduler_module
    # The swap lasts only while the scheduler is being built.
    assert scheduler_module.KVCacheManager is not module.KVCacheManager


def test_scheduler_init_builds_pagedkv_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """While vLLM's Scheduler.__init__ runs, its module names pagedkv's manager."""
    _, _, module = _make()
    from vllm.v1.core.sched import scheduler as scheduler_module

    seen: list[Any] = []

    def fake_init(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(scheduler_module.KVCacheManager)

    monkeypatch.setattr(scheduler_module.Scheduler, "__init__", fake_init)
    module.Scheduler()
    assert seen == [module.KVCacheManager]
    assert scheduler_module.KVCacheManager is not module.KVCacheManager
