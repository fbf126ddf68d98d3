"""The KV cache spec classes, the registry and the model setting (spec/config.md, CFG-1..CFG-13)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.spec.errors import IncompatibleSpecError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.registry import manager_kind_for, register_kv_cache_spec, registered_spec_types
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.sizing import cdiv
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

BF16 = "bfloat16"
block_sizes = st.sampled_from([1, 4, 16, 64])
heads = st.integers(1, 8)
head_sizes = st.sampled_from([64, 128, 576])
dtypes = st.sampled_from(["bfloat16", "float32", "fp8_e4m3"])


@st.composite
def full_specs(draw: st.DrawFn) -> FullAttentionSpec:
    return FullAttentionSpec(
        draw(block_sizes), draw(heads), draw(head_sizes), draw(dtypes),
        head_size_v=draw(st.none() | head_sizes),
        sliding_window=draw(st.none() | st.sampled_from([512, 1024])))


@st.composite
def any_spec(draw: st.DrawFn) -> KVCacheSpec:
    bs, h, hs, dt = draw(block_sizes), draw(heads), draw(head_sizes), draw(dtypes)
    return draw(st.sampled_from([
        FullAttentionSpec(bs, h, hs, dt),
        MLAAttentionSpec(bs, 1, hs, dt),
        SinkFullAttentionSpec(bs, h, hs, dt, sink_len=bs * 2),
        SlidingWindowSpec(bs, h, hs, dt, 1024),
        ChunkedLocalAttentionSpec(bs, h, hs, dt, 2048),
        CrossAttentionSpec(bs, h, hs, dt),
        MambaSpec(bs, ((h, 3), (h, hs)), (dt, dt), mamba_cache_mode="align"),
    ]))


settings_st = st.builds(
    ModelSetting, max_model_len=st.integers(1, 200_000),
    max_num_batched_tokens=st.integers(1, 16_384),
    max_num_encoder_input_tokens=st.none() | st.integers(1, 4096))


# --- page sizes (CFG-2..CFG-5) --------------------------------------------------------

def test_page_sizes_follow_the_formulas() -> None:
    """CFG-2 (attention), CFG-3 (full attention), CFG-4 (MLA), CFG-5 (Mamba)."""
    assert FullAttentionSpec(16, 8, 128, BF16).page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert FullAttentionSpec(16, 8, 128, BF16, head_size_v=64).page_size_bytes == 16 * 8 * (128 + 64) * 2
    assert SlidingWindowSpec(16, 8, 128, "float32", 1024).page_size_bytes == 2 * 16 * 8 * 128 * 4
    assert MLAAttentionSpec(64, 1, 576, BF16).page_size_bytes == 64 * 576 * 2
    assert MLAAttentionSpec(64, 1, 576, "uint8", cache_dtype_str="fp8_ds_mla").page_size_bytes == 64 * 656
    assert MambaSpec(8192, ((8192, 3), (8192, 16)), (BF16, "float32")).page_size_bytes == \
        8192 * 3 * 2 + 8192 * 16 * 4


def test_padding_replaces_the_page_and_must_not_shrink_it() -> None:
    spec = FullAttentionSpec(16, 8, 128, BF16, page_size_padded=70_000)
    assert spec.page_size_bytes == 70_000 and spec.real_page_size_bytes == 65_536
    with pytest.raises(InvalidConfigError, match="page_size_padded"):
        FullAttentionSpec(16, 8, 128, BF16, page_size_padded=65_535)
    with pytest.raises(InvalidConfigError, match="page_size_padded"):
        MambaSpec(4, ((4, 4),), (BF16,), page_size_padded=1)


@given(any_spec(), st.sampled_from([1, 2, 3, 8]))
def test_attention_pages_scale_with_the_block_size(spec: KVCacheSpec, factor: int) -> None:
    bigger = spec.copy_with_new_block_size(spec.block_size * factor)
    assert bigger.block_size == spec.block_size * factor
    if isinstance(spec, MambaSpec):
        assert bigger.page_size_bytes == spec.page_size_bytes
    else:
        assert bigger.page_size_bytes == spec.page_size_bytes * factor


# --- validation (CFG-1) ---------------------------------------------------------------

BAD: list[tuple[Callable[[], object], str]] = [
    (lambda: FullAttentionSpec(0, 8, 128, BF16), "block_size"),
    (lambda: FullAttentionSpec(-16, 8, 128, BF16), "block_size"),
    (lambda: FullAttentionSpec(16, 0, 128, BF16), "num_kv_heads"),
    (lambda: FullAttentionSpec(16, 8, -1, BF16), "head_size"),
    (lambda: FullAttentionSpec(16, 8, 128, "float13"), "dtype"),
    (lambda: FullAttentionSpec(16, 8, 128, BF16, head_size_v=0), "head_size_v"),
    (lambda: FullAttentionSpec(16, 8, 128, BF16, sliding_window=8, attention_chunk_size=8), "attention_chunk_size"),
    (lambda: SlidingWindowSpec(16, 8, 128, BF16, 0), "sliding_window"),
    (lambda: ChunkedLocalAttentionSpec(16, 8, 128, BF16, -4), "attention_chunk_size"),
    (lambda: MLAAttentionSpec(64, 2, 576, BF16, cache_dtype_str="fp8_ds_mla"), "num_kv_heads"),
    (lambda: MLAAttentionSpec(64, 1, 512, BF16, cache_dtype_str="fp8_ds_mla"), "head_size"),
    (lambda: MLAAttentionSpec(64, 1, 576, BF16, head_size_v=64), "head_size_v"),
    (lambda: SinkFullAttentionSpec(16, 8, 128, BF16, sink_len=0), "sink_len"),
    (lambda: MambaSpec(16, (), ()), "shapes"),
    (lambda: MambaSpec(16, ((4, 0),), (BF16,)), "shapes[0]"),
    (lambda: MambaSpec(16, ((4, 4),), (BF16, BF16)), "dtypes"),
    (lambda: MambaSpec(16, ((4, 4),), ("int4",)), "dtypes[0]"),
    (lambda: MambaSpec(16, ((4, 4),), (BF16,), mamba_cache_mode="some"), "mamba_cache_mode"),
    (lambda: MambaSpec(16, ((4, 4),), (BF16,), num_speculative_blocks=-1), "num_speculative_blocks"),
    (lambda: ModelSetting(0), "max_model_len"),
    (lambda: ModelSetting(8, max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: ModelSetting(8, dcp_world_size=0), "dcp_world_size"),
    (lambda: ModelSetting(8, num_gpu_blocks_override=0), "num_gpu_blocks_override"),
    (lambda: UniformTypeKVCacheSpecs(16, ()), "kv_cache_specs"),
]


@pytest.mark.parametrize(("build", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_values_raise_naming_the_field(build: Callable[[], object], field: str) -> None:
    with pytest.raises(InvalidConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        build()


@given(any_spec())
def test_specs_are_frozen_and_hashable(spec: KVCacheSpec) -> None:
    assert hash(spec) == hash(dataclasses.replace(spec))
    assert spec == dataclasses.replace(spec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 1  # type: ignore[misc]
    assert not hasattr(spec, "__dict__")


# --- memory usage and admission caps (CFG-6..CFG-10) ------------------------------------

@given(settings_st, any_spec())
def test_max_memory_usage_is_whole_pages_and_positive(setting: ModelSetting, spec: KVCacheSpec) -> None:
    usage = spec.max_memory_usage_bytes(setting)
    assert usage >= spec.page_size_bytes
    assert usage % spec.page_size_bytes == 0


@given(settings_st, st.sampled_from([1, 16, 64]), st.integers(1, 40_000))
def test_sliding_window_cap(setting: ModelSetting, block_size: int, window: int) -> None:
    """CFG-7: the sliding-window admission cap and usage."""
    spec = SlidingWindowSpec(block_size, 8, 128, BF16, window)
    cap = spec.max_admission_blocks_per_request(setting.max_num_batched_tokens, setting.max_model_len)
    tokens = min(window - 1 + setting.max_num_batched_tokens, setting.max_model_len)
    assert cap == cdiv(tokens, block_size) + 1
    assert cap <= cdiv(setting.max_model_len, block_size) + 1
    assert spec.max_memory_usage_bytes(setting) == cap * spec.page_size_bytes


def test_sliding_window_cap_example() -> None:
    # window 4096, 2048-token chunks, block 16: 4095 kept + 2048 new = 6143 tokens
    # -> 384 blocks, plus one for a window not aligned to a block.
    spec = SlidingWindowSpec(16, 8, 128, BF16, 4096)
    assert spec.max_admission_blocks_per_request(2048, 131_072) == 385
    assert spec.max_admission_blocks_per_request(2048, 1000) == 64  # capped by max_model_len


@given(settings_st, st.sampled_from([1, 16, 64]), st.integers(1, 40_000))
def test_chunked_local_cap(setting: ModelSetting, block_size: int, chunk: int) -> None:
    """CFG-8: the chunked-local admission cap."""
    spec = ChunkedLocalAttentionSpec(block_size, 8, 128, BF16, chunk)
    cap = spec.max_admission_blocks_per_request(setting.max_num_batched_tokens, setting.max_model_len)
    assert cap == cdiv(min(chunk + setting.max_num_batched_tokens, setting.max_model_len), block_size)
    assert 1 <= cap <= cdiv(setting.max_model_len, block_size)


def test_full_attention_usage_with_context_parallelism() -> None:
    spec = FullAttentionSpec(16, 8, 128, BF16)
    assert spec.max_memory_usage_bytes(ModelSetting(8192)) == 512 * spec.page_size_bytes
    assert spec.max_memory_usage_bytes(ModelSetting(8192, dcp_world_size=2, pcp_world_size=2)) == \
        128 * spec.page_size_bytes
    sink = SinkFullAttentionSpec(16, 8, 128, BF16, sink_len=20)
    assert sink.max_memory_usage_bytes(ModelSetting(8192)) == (512 + 2) * sink.page_size_bytes
    with pytest.raises(InvalidConfigError, match="dcp_world_size"):
        SlidingWindowSpec(16, 8, 128, BF16, 64).max_memory_usage_bytes(ModelSetting(64, dcp_world_size=2))


def test_mamba_and_cross_attention_usage() -> None:
    """CFG-9 (Mamba pages per mode) and CFG-10 (cross attention)."""
    shapes, dts = ((16, 16),), (BF16,)
    setting = ModelSetting(1000, max_num_encoder_input_tokens=1500)
    page = 16 * 16 * 2
    assert MambaSpec(1000, shapes, dts).max_memory_usage_bytes(setting) == page
    assert MambaSpec(1000, shapes, dts, num_speculative_blocks=2).max_memory_usage_bytes(setting) == 3 * page
    assert MambaSpec(16, shapes, dts, mamba_cache_mode="align").max_memory_usage_bytes(setting) == 2 * page
    assert MambaSpec(16, shapes, dts, mamba_cache_mode="all").max_memory_usage_bytes(setting) == 63 * page
    cross = CrossAttentionSpec(16, 8, 64, BF16)
    assert cross.max_memory_usage_bytes(setting) == cdiv(1500, 16) * cross.page_size_bytes
    assert cross.max_memory_usage_bytes(ModelSetting(1000, max_num_batched_tokens=320)) == \
        20 * cross.page_size_bytes


# --- merge (CFG-11) ---------------------------------------------------------------------

@given(any_spec(), st.integers(1, 5))
def test_merge_of_equal_specs_is_the_spec(spec: KVCacheSpec, n: int) -> None:
    assert type(spec).merge([spec] * n) == spec


@given(st.lists(full_specs(), min_size=1, max_size=5), st.randoms())
def test_full_attention_merge_is_idempotent_and_order_independent(
        specs: list[FullAttentionSpec], rnd: Any) -> None:
    base = specs[0]
    # Same shape as the first, windows drawn independently.
    group = [dataclasses.replace(base, sliding_window=s.sliding_window) for s in specs]
    shuffled = list(group)
    rnd.shuffle(shuffled)
    try:
        merged = FullAttentionSpec.merge(group)
    except IncompatibleSpecError as exc:
        assert "sliding_window" in str(exc)
        with pytest.raises(IncompatibleSpecError):
            FullAttentionSpec.merge(shuffled)
        return
    assert FullAttentionSpec.merge(shuffled) == merged
    assert FullAttentionSpec.merge([merged]) == merged
    assert FullAttentionSpec.merge([merged, *group]) == merged


def test_merge_names_the_differing_field() -> None:
    a = FullAttentionSpec(16, 8, 128, BF16)
    with pytest.raises(IncompatibleSpecError, match="num_kv_heads"):
        FullAttentionSpec.merge([a, FullAttentionSpec(16, 4, 128, BF16)])
    with pytest.raises(IncompatibleSpecError, match="type"):
        FullAttentionSpec.merge([a, SlidingWindowSpec(16, 8, 128, BF16, 64)])
    with pytest.raises(IncompatibleSpecError, match="sliding_window"):
        SlidingWindowSpec.merge([SlidingWindowSpec(16, 8, 128, BF16, 64), SlidingWindowSpec(16, 8, 128, BF16, 32)])
    with pytest.raises(IncompatibleSpecError, match="cache_dtype_str"):
        MLAAttentionSpec.merge([MLAAttentionSpec(64, 1, 576, BF16),
                                MLAAttentionSpec(64, 1, 576, BF16, cache_dtype_str="fp8_ds_mla")])
    with pytest.raises(InvalidConfigError, match="at least one"):
        FullAttentionSpec.merge([])
    merged = FullAttentionSpec.merge([a, FullAttentionSpec(16, 8, 128, BF16, attention_chunk_size=8192)])
    assert merged.attention_chunk_size == 8192


# --- registry and uniform type (CFG-13) --------------------------------------------------

def test_builtin_manager_kinds() -> None:
    assert manager_kind_for(FullAttentionSpec(16, 8, 128, BF16)) == "full_attention"
    assert manager_kind_for(MLAAttentionSpec(16, 1, 576, BF16)) == "full_attention"
    assert manager_kind_for(SinkFullAttentionSpec(16, 8, 128, BF16)) == "sink_full_attention"
    assert manager_kind_for(SlidingWindowSpec(16, 8, 128, BF16, 4)) == "sliding_window"
    assert manager_kind_for(ChunkedLocalAttentionSpec(16, 8, 128, BF16, 4)) == "chunked_local"
    assert manager_kind_for(CrossAttentionSpec(16, 8, 128, BF16)) == "cross_attention"
    assert manager_kind_for(MambaSpec(16, ((2, 2),), (BF16,))) == "mamba"


@dataclasses.dataclass(frozen=True, slots=True)
class _EngineSpec(KVCacheSpec):
    bytes_per_token: int = 1

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclasses.dataclass(frozen=True, slots=True)
class _EngineFullSpec(FullAttentionSpec):
    pass


def test_engines_register_their_own_spec_types() -> None:
    spec = _EngineSpec(16)
    with pytest.raises(InvalidConfigError, match="register_kv_cache_spec"):
        manager_kind_for(spec)
    assert manager_kind_for(_EngineFullSpec(16, 8, 128, BF16)) == "full_attention"  # inherited
    register_kv_cache_spec(_EngineSpec, "engine_kind")
    register_kv_cache_spec(_EngineSpec, "engine_kind")  # same kind again: no-op
    assert manager_kind_for(spec) == "engine_kind"
    assert registered_spec_types()[_EngineSpec] == "engine_kind"
    with pytest.raises(InvalidConfigError, match="already served"):
        register_kv_cache_spec(_EngineSpec, "other_kind")
    with pytest.raises(InvalidConfigError, match="spec_type"):
        register_kv_cache_spec(int, "x")  # type: ignore[arg-type]


def test_uniform_type_specs() -> None:
    a, b = FullAttentionSpec(16, 8, 128, BF16), FullAttentionSpec(16, 4, 64, BF16)
    uniform = UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b})
    assert uniform is not None
    assert uniform.page_size_bytes == a.page_size_bytes + b.page_size_bytes
    setting = ModelSetting(100)
    assert uniform.max_memory_usage_bytes(setting) == cdiv(100, 16) * uniform.page_size_bytes
    assert hash(uniform) == hash(UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b}))
    assert uniform.copy_with_new_block_size(32).specs_by_layer()["b"].block_size == 32
    sw = SlidingWindowSpec(16, 8, 128, BF16, 64)
    assert UniformTypeKVCacheSpecs.from_specs({"a": a, "s": sw}) is None
    assert UniformTypeKVCacheSpecs.from_specs(
        {"s": sw, "t": SlidingWindowSpec(16, 8, 128, BF16, 32)}) is None  # other window
    assert UniformTypeKVCacheSpecs.from_specs({"a": a, "c": FullAttentionSpec(32, 8, 128, BF16)}) is None
    assert not UniformTypeKVCacheSpecs.is_uniform_type({})
    with pytest.raises(IncompatibleSpecError, match="block_size"):
        UniformTypeKVCacheSpecs(16, (("a", a), ("c", FullAttentionSpec(32, 8, 128, BF16))))
