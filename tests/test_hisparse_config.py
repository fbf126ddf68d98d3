"""Configuration and checker tests of the host tier (spec/host_tier.md): the
derived specs and planning helpers, the device manager's refusal of host
groups, vLLM's HiSparse configuration read without vLLM, and a planted
corruption per HOST-* invariant named by the reference's checker."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.reference.features.hisparse import HostTierManager as ReferenceTier
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hisparse import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    HostTierConfig,
    device_groups,
    host_groups,
    host_tier_config,
)
from pagedkv.spec.kv_cache_spec import FullAttentionSpec
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.types import BlockHash

B = 4


def _hashes(n: int, tag: int = 0) -> list[BlockHash]:
    return [BlockHash(bytes([tag, i])) for i in range(n)]


def test_derived_specs_sizes_and_planning_excludes_host_groups() -> None:
    hot = HiSparseHotSpec(16, page_size=64, blocks_per_request=2)
    resident = HiSparseResidentSpec(16, page_size=64)
    setting = ModelSetting(max_model_len=32768, max_num_batched_tokens=2048)
    assert hot.page_size_bytes == 64 and hot.max_memory_usage_bytes(setting) == 128
    assert resident.max_memory_usage_bytes(setting) == 128 * 64  # capped at the in-flight window
    source = FullAttentionSpec(16, 1, 1, "float32")
    groups = (
        KVCacheGroupSpec(("source",), source, host_resident=True, role="hisparse_source"),
        KVCacheGroupSpec(("indexer",), source, role="hisparse_indexer"),
        KVCacheGroupSpec(("resident",), resident),
        KVCacheGroupSpec(("hot",), hot),
    )
    assert host_groups(groups) == (0,)
    assert [g.layer_names for g in device_groups(groups)] == [("indexer",), ("resident",), ("hot",)]
    config = KVCacheConfig(32, (), groups)
    tier = host_tier_config(config, host_num_blocks=16, max_model_len=128)
    assert (tier.block_size, tier.host_num_blocks, tier.device_num_blocks,
            tier.hot_blocks_per_request, tier.device_watermark) == (16, 16, 32, 2, 3)
    assert tier.admission_window is None
    windowed = host_tier_config(config, 16, max_model_len=128, max_num_batched_tokens=40)
    assert windowed.admission_window == 3  # cdiv(min(40, 128), 16)


def test_host_pool_sizing_and_steady_state_concurrency() -> None:
    from pagedkv.spec.errors import InsufficientMemoryError
    from pagedkv.spec.hisparse import host_pool_num_blocks, steady_state_concurrency

    assert host_pool_num_blocks(64 * 100 + 63, 64, 16, 128) == 100
    with pytest.raises(InsufficientMemoryError, match="needs 10"):
        host_pool_num_blocks(64 * 9, 64, 16, 128)  # cdiv(128, 16) + 2 = 10
    source = FullAttentionSpec(16, 1, 1, "float32")  # 128-byte pages
    groups = (
        KVCacheGroupSpec(("source",), source, host_resident=True, role="hisparse_source"),
        KVCacheGroupSpec(("indexer",), source, role="hisparse_indexer"),
        KVCacheGroupSpec(("resident",), HiSparseResidentSpec(16, page_size=128)),
        KVCacheGroupSpec(("hot",), HiSparseHotSpec(16, page_size=128, blocks_per_request=2)),
    )
    setting = ModelSetting(max_model_len=256, max_num_batched_tokens=64)
    # Per request: 16 indexer + 4 resident (window) + 2 hot to admit; 16 + 2 + 2 steady.
    config = KVCacheConfig(22 + 20 * 3, (), groups)
    assert steady_state_concurrency(config, host_num_blocks=1000, setting=setting) == 4.0
    assert steady_state_concurrency(config, host_num_blocks=32, setting=setting) == 2.0


@pytest.mark.parametrize("implementation", ["reference", "optimized"])
def test_the_device_manager_refuses_host_resident_groups(implementation: str) -> None:
    import pagedkv.optimized
    import pagedkv.reference

    module = pagedkv.reference if implementation == "reference" else pagedkv.optimized
    source = FullAttentionSpec(16, 1, 1, "float32")
    config = KVCacheConfig(16, (), (KVCacheGroupSpec(("source",), source, host_resident=True,
                                                     role="hisparse_source"),))
    with pytest.raises(InvalidConfigError, match="host_resident"):
        module.KVCacheManager(config, max_model_len=64)


def test_bad_hisparse_configs_are_refused() -> None:
    source = FullAttentionSpec(16, 1, 1, "float32")
    hot = KVCacheGroupSpec(("hot",), HiSparseHotSpec(16, page_size=64, blocks_per_request=2))
    with pytest.raises(InvalidConfigError, match="role"):
        KVCacheGroupSpec(("x",), source, role="leader")
    with pytest.raises(InvalidConfigError, match="blocks_per_request"):
        HiSparseHotSpec(16, page_size=64, blocks_per_request=0)
    with pytest.raises(InvalidConfigError, match="exactly one"):
        host_tier_config(KVCacheConfig(8, (), (hot,)), 8, 64)
    not_source = KVCacheGroupSpec(("s",), source, host_resident=True)
    with pytest.raises(InvalidConfigError, match="hisparse_source"):
        host_tier_config(KVCacheConfig(8, (), (not_source, hot)), 8, 64)


# -- vLLM's HiSparse configuration, read without vLLM (class names as vLLM's) --

class FullAttentionSpec_:  # noqa: N801 - renamed below to vLLM's class name
    def __init__(self) -> None:
        self.block_size, self.num_kv_heads, self.head_size, self.dtype = 16, 1, 1, "torch.float32"


class HiSparseResidentSpec_:  # noqa: N801
    block_size, page_size = 16, 64


class HiSparseHotSpec_:  # noqa: N801
    block_size, page_size, blocks_per_request = 16, 64, 2


for _fake in (FullAttentionSpec_, HiSparseResidentSpec_, HiSparseHotSpec_):
    _fake.__name__ = _fake.__name__.rstrip("_")


class _Role:
    def __init__(self, value: str) -> None:
        self.value = value


class _Group:
    def __init__(self, name: str, spec: object, host_resident: bool = False,
                 role: str = "default") -> None:
        self.layer_names, self.kv_cache_spec = [name], spec
        self.host_resident, self.role = host_resident, _Role(role)


class _VllmConfig:
    def __init__(self, host_num_blocks: int | None) -> None:
        self.num_blocks, self.hisparse_host_num_blocks = 32, host_num_blocks
        self.kv_cache_groups = [
            _Group("source", FullAttentionSpec_(), True, "hisparse_source"),
            _Group("indexer", FullAttentionSpec_(), role="hisparse_indexer"),
            _Group("resident", HiSparseResidentSpec_()),
            _Group("hot", HiSparseHotSpec_()),
        ]


def test_vllm_hisparse_config_translates_to_a_host_tier() -> None:
    from pagedkv.vllm.hisparse import is_hisparse_config, translate_hisparse_config

    assert not is_hisparse_config(_VllmConfig(None))
    config, tier = translate_hisparse_config(_VllmConfig(16), max_model_len=128,
                                             max_num_batched_tokens=64)
    assert [(g.host_resident, g.role) for g in config.kv_cache_groups] == [
        (True, "hisparse_source"), (False, "hisparse_indexer"), (False, "default"),
        (False, "default")]
    assert isinstance(config.kv_cache_groups[3].kv_cache_spec, HiSparseHotSpec)
    assert (tier.host_num_blocks, tier.device_num_blocks, tier.hot_blocks_per_request,
            tier.admission_window) == (16, 32, 2, 4)
    assert tier.num_reprefillable_tokens == 0 and tier.spill_budget == 128 // 16
    # A drafter re-prefilling 3 tokens leaves the last 2 of them out of write-backs.
    _, drafted = translate_hisparse_config(_VllmConfig(16), max_model_len=128,
                                           num_prefill_lookahead=3)
    assert drafted.num_reprefillable_tokens == 2
    with pytest.raises(InvalidConfigError, match="hisparse_host_num_blocks"):
        translate_hisparse_config(_VllmConfig(None), max_model_len=128)


# -- planted corruptions: the reference's checker names each broken HOST-* ID --

def _busy_reference() -> ReferenceTier:
    tier = ReferenceTier(HostTierConfig(block_size=B, host_num_blocks=16, device_num_blocks=16,
                                        hot_blocks_per_request=1, max_model_len=64))
    tier.allocate("a", 20, block_hashes=_hashes(5))
    tier.complete([t.transfer_id for t in tier.plan_writebacks("a", 20)])
    tier.require_hot("a")
    tier.allocate("a", 20)
    tier.update_residency("a")  # pages 0..2 unpinned, 3..4 pinned tail
    tier.allocate("b", 8)
    tier.plan_writebacks("b", 8)  # two write-backs in flight
    tier.check_invariants()
    return tier


def _corrupt_free_null(t: ReferenceTier) -> None:
    t.host.free.append(0)


def _corrupt_host_ref(t: ReferenceTier) -> None:
    t.host.ref[t.requests["a"].host_row[0]] += 1


def _corrupt_device_ref(t: ReferenceTier) -> None:
    t.device.ref[t.requests["a"].resident_row[4]] += 1


def _corrupt_host_row(t: ReferenceTier) -> None:
    t.requests["a"].host_row.pop()


def _corrupt_dirty_host_only(t: ReferenceTier) -> None:
    t.requests["b"].resident_row[0] = 0


def _corrupt_unpinned_dirty(t: ReferenceTier) -> None:
    t.requests["a"].clean.discard(1)


def _corrupt_hot(t: ReferenceTier) -> None:
    t.requests["a"].hot.append(t.requests["a"].hot[0])


def _corrupt_no_hot(t: ReferenceTier) -> None:
    t.device.release(t.requests["a"].hot)
    t.requests["a"].hot = []


def _corrupt_published(t: ReferenceTier) -> None:
    t.requests["b"].published = 1


def _corrupt_tail(t: ReferenceTier) -> None:
    req = t.requests["a"]
    t.device.release([req.resident_row[4]])
    t.readers[req.resident_row[4]] = {("a", 4)}
    req.unpinned.add(4)


def _corrupt_synced(t: ReferenceTier) -> None:
    t.requests["b"].stale.add(0)


def _corrupt_copy(t: ReferenceTier) -> None:
    t.copies[next(iter(t.host.cached))] = t.requests["a"].hot[0]


@pytest.mark.parametrize(("invariant", "corrupt"), [
    ("HOST-11", _corrupt_synced), ("HOST-12", _corrupt_copy),
    ("HOST-1", _corrupt_free_null), ("HOST-2", _corrupt_host_ref),
    ("HOST-3", _corrupt_device_ref), ("HOST-4", _corrupt_host_row),
    ("HOST-5", _corrupt_dirty_host_only), ("HOST-6", _corrupt_unpinned_dirty),
    ("HOST-7", _corrupt_hot), ("HOST-8", _corrupt_no_hot), ("HOST-9", _corrupt_published),
    ("HOST-10", _corrupt_tail),
])
def test_the_checker_names_each_broken_invariant(
        invariant: str, corrupt: Callable[[ReferenceTier], None]) -> None:
    from pagedkv.spec.errors import InvariantViolation

    tier = _busy_reference()
    corrupt(tier)
    with pytest.raises(InvariantViolation, match=f"^{invariant}: "):
        tier.check_invariants()
