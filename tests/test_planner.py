"""The KV cache planner and capacity functions (spec/config.md, CFG-12..CFG-27)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.spec.capacity import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_max_concurrency_for_kv_cache_config,
    kv_cache_size_tokens,
    max_memory_usage_bytes,
)
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, check_kv_cache_config
from pagedkv.spec.errors import (
    IncompatibleSpecError,
    InsufficientMemoryError,
    InvalidConfigError,
    InvariantViolation,
)
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.planner import (
    get_kv_cache_config,
    get_kv_cache_groups,
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_configs,
    unify_kv_cache_spec_page_size,
)
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

BF16 = "bfloat16"
GiB = 1 << 30
FULL = FullAttentionSpec(16, 8, 128, BF16)
SW = SlidingWindowSpec(16, 8, 128, BF16, 1024)

# Layer kinds a generated model draws from: mostly one page size, sometimes others.
KINDS: list[KVCacheSpec] = [
    FULL, SW, SlidingWindowSpec(16, 8, 128, BF16, 128), ChunkedLocalAttentionSpec(16, 8, 128, BF16, 512),
    FullAttentionSpec(16, 4, 128, BF16), CrossAttentionSpec(16, 8, 128, BF16),
    MambaSpec(16, ((64, 4), (64, 128)), (BF16, "float32")),
]


@st.composite
def models(draw: st.DrawFn) -> dict[str, KVCacheSpec]:
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True))
    layers = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=24))
    return {f"layers.{i}": spec for i, spec in enumerate(layers)}


settings_st = st.builds(
    ModelSetting, max_model_len=st.integers(1, 40_000), max_num_batched_tokens=st.integers(1, 4096),
    disable_hybrid_kv_cache_manager=st.sampled_from([False, False, False, True]))
memories = st.integers(1, 8 * GiB) | st.sampled_from([GiB, 4 * GiB, 16 * GiB])


def _plan(setting: ModelSetting, specs: dict[str, KVCacheSpec], memory: int) -> KVCacheConfig | None:
    try:
        return get_kv_cache_config(setting, specs, memory)
    except (InsufficientMemoryError, IncompatibleSpecError):
        return None


@given(settings_st, models(), memories)
def test_planned_configs_are_well_formed(setting: ModelSetting, specs: dict[str, KVCacheSpec],
                                         memory: int) -> None:
    config = _plan(setting, specs, memory)
    if config is None:
        return
    # CFG-16: the tensors fit in the memory.
    assert sum(t.size for t in config.kv_cache_tensors) <= memory
    # CFG-20..CFG-23: each layer in exactly one group, a tensor shared by at most
    # one layer of each group, each layer backed by exactly one tensor, one page size.
    check_kv_cache_config(config)
    grouped = [name for g in config.kv_cache_groups for name in g.layer_names]
    assert sorted(grouped) == sorted(specs)
    # A tensor holds num_blocks pages of each layer sharing it.
    for tensor in config.kv_cache_tensors:
        assert tensor.size % config.num_blocks == 0
    # CFG-17: the planned specs hold one request of max_model_len.
    _, used = get_kv_cache_groups(setting, specs)
    assert max_memory_usage_bytes(setting, used.values()) <= memory
    assert kv_cache_size_tokens(setting, config) >= 0
    assert get_max_concurrency_for_kv_cache_config(setting, config) > 0


@given(settings_st, models(), memories)
def test_max_model_len_estimate_is_maximal(setting: ModelSetting, specs: dict[str, KVCacheSpec],
                                           memory: int) -> None:
    """CFG-18: the estimate fits and one token more does not."""
    try:
        _, used = get_kv_cache_groups(setting, specs)
    except IncompatibleSpecError:
        return
    limit = 100_000

    def fits(length: int) -> bool:
        try:
            return max_memory_usage_bytes(setting.with_max_model_len(length), used.values()) <= memory
        except InvalidConfigError:
            return False

    best = estimate_max_model_len(setting, used, memory, search_limit=limit)
    assert 0 <= best <= limit
    if best == 0:
        assert not fits(1)
    else:
        assert fits(best)
        assert best == limit or not fits(best + 1)
    if setting.max_model_len <= limit and fits(setting.max_model_len):
        assert best >= setting.max_model_len


def test_grouping_of_10_full_and_20_sliding_window_layers() -> None:
    """CFG-14: a type's layers dealt out to its groups."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(30):
        specs[f"layers.{i}"] = FULL if i % 3 == 0 else SW
    config = get_kv_cache_config(ModelSetting(4096), specs, 4 * GiB)
    names = [g.layer_names for g in config.kv_cache_groups]
    assert names[0] == tuple(f"layers.{i}" for i in range(0, 30, 3))
    sw = [f"layers.{i}" for i in range(30) if i % 3]
    # A type's layers are dealt out to its groups in turn (vLLM 0.33).
    assert names[1] == tuple(sw[0::2]) and names[2] == tuple(sw[1::2])
    assert len(config.kv_cache_tensors) == 10
    assert config.kv_cache_tensors[0].shared_by == ("layers.0", "layers.1", "layers.2")
    assert config.num_blocks == 4 * GiB // FULL.page_size_bytes // 10


def test_padding_the_last_group_of_a_type() -> None:
    specs: dict[str, KVCacheSpec] = {"f0": FULL, "f1": FULL, "s0": SW, "s1": SW, "s2": SW}
    config = get_kv_cache_config(ModelSetting(1024), specs, GiB)
    assert [g.layer_names for g in config.kv_cache_groups] == [("f0", "f1"), ("s0", "s2"), ("s1",)]
    assert [t.shared_by for t in config.kv_cache_tensors] == [("f0", "s0", "s1"), ("f1", "s2")]


def test_types_of_nearly_equal_size_share_the_larger_group_size() -> None:
    # 3 full + 4 sliding window: 4 < 1.5 * 3, so one group per type (the full one padded).
    specs: dict[str, KVCacheSpec] = {f"f{i}": FULL for i in range(3)}
    specs.update({f"s{i}": SW for i in range(4)})
    config = get_kv_cache_config(ModelSetting(1024), specs, GiB)
    assert [g.layer_names for g in config.kv_cache_groups] == [
        ("f0", "f1", "f2"), ("s0", "s1", "s2", "s3")]
    assert config.num_blocks == GiB // FULL.page_size_bytes // 4


def test_attention_free_and_uniform_type() -> None:
    """CFG-14 (attention free, uniform type), CFG-24 and CFG-19 of an attention-free config."""
    config = get_kv_cache_config(ModelSetting(1024), {}, GiB)
    assert config == KVCacheConfig(1, (), ())
    assert kv_cache_size_tokens(ModelSetting(1024), config) == 0
    with pytest.raises(InvalidConfigError, match="kv_cache_groups"):
        get_max_concurrency_for_kv_cache_config(ModelSetting(1024), config)
    small = FullAttentionSpec(16, 4, 128, BF16)
    config = get_kv_cache_config(ModelSetting(1024), {"a": FULL, "b": small}, GiB)
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert config.num_blocks == GiB // (FULL.page_size_bytes + small.page_size_bytes)
    assert [t.size for t in config.kv_cache_tensors] == [
        FULL.page_size_bytes * config.num_blocks, small.page_size_bytes * config.num_blocks]


def test_uniform_model_figures() -> None:
    """CFG-12 (blocks), CFG-24 (size in tokens), CFG-19 (concurrency), CFG-18 (largest length)."""
    specs = {f"layers.{i}": FULL for i in range(32)}
    setting = ModelSetting(8192)
    config = get_kv_cache_config(setting, specs, 40 * GiB)
    assert config.num_blocks == 20480
    assert kv_cache_size_tokens(setting, config) == 327_680
    assert get_max_concurrency_for_kv_cache_config(setting, config) == 40.0
    assert estimate_max_model_len(setting, specs, 40 * GiB) == 327_680


def test_insufficient_memory_message() -> None:
    specs = {f"layers.{i}": FULL for i in range(32)}
    with pytest.raises(InsufficientMemoryError) as info:
        check_enough_kv_cache_memory(ModelSetting(8192), specs, GiB // 2)
    message = str(info.value)
    assert "1073741824 bytes" in message and "536870912 bytes" in message
    assert re.search(r"largest max_model_len that fits is 4096\b", message)
    with pytest.raises(InsufficientMemoryError, match="not even"):
        check_enough_kv_cache_memory(ModelSetting(8192), specs, 1000)
    with pytest.raises(InsufficientMemoryError, match="available_memory"):
        get_kv_cache_config(ModelSetting(8192), specs, 0)
    with pytest.raises(InvalidConfigError, match="available_memory"):
        get_kv_cache_config(ModelSetting(8192), specs, -1)
    check_enough_kv_cache_memory(ModelSetting(8192), {}, 0)  # attention free: nothing needed


def test_num_gpu_blocks_override() -> None:
    specs = {"a": FULL, "b": FULL}
    config = get_kv_cache_config(ModelSetting(64, num_gpu_blocks_override=10), specs, GiB)
    assert config.num_blocks == 10
    assert all(t.size == 10 * FULL.page_size_bytes for t in config.kv_cache_tensors)
    with pytest.raises(InsufficientMemoryError, match="num_gpu_blocks_override"):
        get_kv_cache_config(ModelSetting(64, num_gpu_blocks_override=10**9), specs, GiB)


def test_unify_hybrid_specs() -> None:
    """CFG-26: the hybrid manager disabled."""
    specs: dict[str, KVCacheSpec] = {"f": FULL, "s": SW, "c": ChunkedLocalAttentionSpec(16, 8, 128, BF16, 64)}
    with pytest.raises(IncompatibleSpecError, match="attention_chunk_size"):
        unify_hybrid_kv_cache_specs(specs)  # a window and a chunk cannot be recorded together
    unified = unify_hybrid_kv_cache_specs({"f": FULL, "s": SW})
    assert unified["s"] == FullAttentionSpec(16, 8, 128, BF16, sliding_window=1024)
    setting = ModelSetting(4096, disable_hybrid_kv_cache_manager=True)
    config = get_kv_cache_config(setting, {"f": FULL, "s": SW}, GiB)
    (group,) = config.kv_cache_groups
    assert group.kv_cache_spec == FullAttentionSpec(16, 8, 128, BF16, sliding_window=1024)
    with pytest.raises(IncompatibleSpecError, match="cannot be unified"):
        unify_hybrid_kv_cache_specs({"f": FULL, "m": MambaSpec(16, ((4, 4),), (BF16,))})


def test_page_size_unification_targets_the_largest_page() -> None:
    """CFG-15."""
    # vLLM 0.33's rule (D-SPEC-17): the common page is the largest one.
    mamba = MambaSpec(8192, ((8192, 3), (8192, 16)), (BF16, BF16), mamba_type="mamba1")
    specs: dict[str, KVCacheSpec] = {"attn": FULL, "m0": mamba, "m1": mamba}
    unified = unify_kv_cache_spec_page_size(specs)
    # 65,536 does not divide the 311,296-byte Mamba state: the attention page is padded.
    assert unified["attn"] == FullAttentionSpec(16, 8, 128, BF16, page_size_padded=311_296)
    assert unified["m0"] == mamba
    # A dividing attention page grows its block size instead.
    quarter = FullAttentionSpec(16, 2, 128, BF16)
    unified = unify_kv_cache_spec_page_size({"a": FULL, "b": SlidingWindowSpec(16, 2, 128, BF16, 64)})
    assert unified["a"] == FULL and unified["b"].block_size == 64
    assert unified["b"].page_size_bytes == FULL.page_size_bytes == 4 * quarter.page_size_bytes
    with pytest.raises(IncompatibleSpecError, match="block_size"):
        unify_kv_cache_spec_page_size({"a": FULL, "b": SlidingWindowSpec(16, 2, 128, BF16, 64)},
                                      max_block_size=32)
    # A smaller Mamba state is padded; an MLA page that does not divide cannot be.
    small = MambaSpec(16, ((1000,),), (BF16,))
    assert unify_kv_cache_spec_page_size({"a": FULL, "m": small})["m"].page_size_bytes == 65_536
    with pytest.raises(IncompatibleSpecError, match="MLA"):
        unify_kv_cache_spec_page_size({"a": FULL, "m": MLAAttentionSpec(16, 1, 576, BF16)})


def test_unify_configs_across_workers() -> None:
    """CFG-25."""
    g1 = KVCacheGroupSpec(("a",), FULL)
    g2 = KVCacheGroupSpec(("b",), SW)
    t = (KVCacheTensor(1 << 20, ("a", "b")),)
    one = KVCacheConfig(100, t, (g1, g2))
    two = KVCacheConfig(80, t, (g2, g1))
    unified = unify_kv_cache_configs([one, two])
    assert [c.num_blocks for c in unified] == [80, 80]
    assert unified[0].kv_cache_groups == unified[1].kv_cache_groups
    assert unify_kv_cache_configs(unified) == unified  # idempotent
    with pytest.raises(IncompatibleSpecError, match="worker 1"):
        unify_kv_cache_configs([one, KVCacheConfig(80, t, (g1,))])
    with pytest.raises(IncompatibleSpecError, match="kv_cache_spec"):
        unify_kv_cache_configs([one, KVCacheConfig(80, t, (g1, KVCacheGroupSpec(("b",), FULL)))])
    with pytest.raises(InvalidConfigError):
        unify_kv_cache_configs([])


def test_check_kv_cache_config_names_the_invariant() -> None:
    group = KVCacheGroupSpec(("a", "b"), FULL)
    with pytest.raises(InvariantViolation, match="^CFG-21"):
        check_kv_cache_config(KVCacheConfig(4, (KVCacheTensor(8, ("a", "b")),), (group,)))
    with pytest.raises(InvariantViolation, match="^CFG-20"):
        check_kv_cache_config(KVCacheConfig(4, (), (group, KVCacheGroupSpec(("a",), FULL))))
    with pytest.raises(InvariantViolation, match="^CFG-22"):
        check_kv_cache_config(KVCacheConfig(4, (KVCacheTensor(8, ("a",)),), (group,)))


def test_bad_inputs_raise_typed_errors() -> None:
    with pytest.raises(InvalidConfigError, match="spec of layer"):
        get_kv_cache_config(ModelSetting(8), {"a": "full"}, GiB)  # type: ignore[dict-item]
    with pytest.raises(InvalidConfigError, match="setting"):
        get_kv_cache_config(8, {"a": FULL}, GiB)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="search_limit"):
        estimate_max_model_len(ModelSetting(8), {"a": FULL}, GiB, search_limit=0)
