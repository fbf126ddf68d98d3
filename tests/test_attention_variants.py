"""vLLM 0.33's newer spec kinds (spec/attention_variants.py; spec/config.md CFG-4a, CFG-9a..9d):
page sizes, memory formulas, manager kinds, merging and planning."""

from __future__ import annotations

import pytest

from pagedkv.spec.attention_variants import (
    CircularBufferSpec,
    EncoderOnlyAttentionSpec,
    RSWASpec,
    SlidingWindowMLASpec,
    prefix_cacheable,
)
from pagedkv.spec.errors import IncompatibleSpecError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from pagedkv.spec.planner import get_kv_cache_config, get_kv_cache_groups
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

SETTING = ModelSetting(max_model_len=8192, max_num_batched_tokens=2048)


def test_compressed_mla_page_counts_states_and_rounds_to_alignment() -> None:
    # 128 tokens, two per stored state: 64 latents of 584 bytes = 37,376, rounded up to 65 * 576.
    spec = MLAAttentionSpec(128, 1, 584, "uint8", tokens_per_state=2, alignment=576)
    assert spec.real_page_size_bytes == 64 * 584
    assert spec.page_size_bytes == 65 * 576
    plain = MLAAttentionSpec(128, 1, 584, "uint8")
    assert plain.page_size_bytes == 128 * 584
    with pytest.raises(InvalidConfigError, match="tokens_per_state"):
        MLAAttentionSpec(16, 1, 576, "bfloat16", tokens_per_state=32)
    with pytest.raises(InvalidConfigError, match="alignment"):
        MLAAttentionSpec(16, 1, 576, "bfloat16", alignment=0)


def test_sliding_window_mla_pages_as_mla_windows_as_sliding_window() -> None:
    spec = SlidingWindowMLASpec(32, 1, 584, "uint8", 128, alignment=576)
    assert spec.page_size_bytes == 19008  # 32 * 584 = 18,688 rounded up to 33 * 576
    assert manager_kind_for(spec) == "sliding_window"
    assert prefix_cacheable(spec)
    assert not prefix_cacheable(SlidingWindowMLASpec(32, 1, 584, "uint8", 128, bounded_replay=True))
    # The same admission cap as plain sliding window, in MLA pages.
    plain = SlidingWindowSpec(32, 1, 584, "uint8", 128)
    blocks = plain.max_memory_usage_bytes(SETTING) // plain.page_size_bytes
    assert spec.max_memory_usage_bytes(SETTING) == blocks * spec.page_size_bytes
    # Not of one uniform type with plain sliding-window layers of the same window.
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": spec, "b": plain.copy_with_new_block_size(32)})


def test_circular_buffer_holds_one_page_per_request_and_is_not_cached() -> None:
    """CFG-9b."""
    ring = CircularBufferSpec(8, 1, 1024, "float32", head_size_v=0)
    assert ring.page_size_bytes == 8 * 1024 * 4
    assert ring.max_memory_usage_bytes(SETTING) == ring.page_size_bytes
    assert ring.max_memory_usage_bytes(ModelSetting(max_model_len=1 << 20)) == ring.page_size_bytes
    assert manager_kind_for(ring) == "circular_buffer"
    assert not prefix_cacheable(ring)
    assert CircularBufferSpec(8, 2, 64, "bfloat16").page_size_bytes == 8 * 2 * 128 * 2
    with pytest.raises(InvalidConfigError, match="head_size_v"):
        CircularBufferSpec(8, 1, 64, "bfloat16", head_size_v=-1)


def test_rswa_plans_as_full_attention_and_has_its_own_manager_kind() -> None:
    """CFG-9c: R-SWA pages as full attention (CFG-6)."""
    spec = RSWASpec(16, 8, 128, "bfloat16", rswa_window=512)
    full = FullAttentionSpec(16, 8, 128, "bfloat16")
    assert spec.page_size_bytes == full.page_size_bytes
    assert spec.max_memory_usage_bytes(SETTING) == full.max_memory_usage_bytes(SETTING)
    assert manager_kind_for(spec) == "rswa"
    with pytest.raises(InvalidConfigError, match="rswa_window"):
        RSWASpec(16, 8, 128, "bfloat16")
    with pytest.raises(IncompatibleSpecError, match="rswa_window"):
        RSWASpec.merge([spec, RSWASpec(16, 8, 128, "bfloat16", rswa_window=256)])
    # Not of one uniform type with plain full attention (another window of visible tokens).
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": spec, "b": full})


def test_non_causal_merges_as_any_and_changes_no_page() -> None:
    causal = FullAttentionSpec(16, 8, 128, "bfloat16")
    prefix_lm = FullAttentionSpec(16, 8, 128, "bfloat16", non_causal=True)
    assert prefix_lm.page_size_bytes == causal.page_size_bytes
    assert FullAttentionSpec.merge([causal, prefix_lm]).non_causal
    assert not FullAttentionSpec.merge([causal, causal]).non_causal
    with pytest.raises(InvalidConfigError, match="non_causal"):
        FullAttentionSpec(16, 8, 128, "bfloat16", non_causal=1)  # type: ignore[arg-type]


def test_encoder_only_layers_take_no_memory_and_join_no_group() -> None:
    """CFG-9d."""
    encoder = EncoderOnlyAttentionSpec(16, 12, 64, "float16")
    assert encoder.max_memory_usage_bytes(SETTING) == 0
    specs = {"enc.0": encoder, "enc.1": encoder}
    decoder = FullAttentionSpec(16, 12, 64, "float16")
    groups, _ = get_kv_cache_groups(SETTING, {**specs, "dec.0": decoder, "dec.1": decoder})
    assert [g.layer_names for g in groups] == [("dec.0", "dec.1")]
    config = get_kv_cache_config(SETTING, specs, 1 << 20)
    assert config.kv_cache_groups == () and config.kv_cache_tensors == ()


def test_planner_groups_sliding_window_mla_beside_compressed_mla() -> None:
    # A DeepSeek-V4-like stack: one compressed MLA layer per four SWA-MLA layers.
    specs: dict[str, object] = {}
    for i in range(4):
        specs[f"l{i}.mla"] = MLAAttentionSpec(64, 1, 584, "uint8", tokens_per_state=2)
        for j in range(4):
            specs[f"l{i}.swa{j}"] = SlidingWindowMLASpec(32, 1, 584, "uint8", 128)
    config = get_kv_cache_config(SETTING, specs, 64 << 20)  # type: ignore[arg-type]
    kinds = sorted(manager_kind_for(g.kv_cache_spec) for g in config.kv_cache_groups)
    assert kinds == ["full_attention"] + ["sliding_window"] * 4
    pages = {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups}
    assert pages == {18688}
    assert sum(t.size for t in config.kv_cache_tensors) <= 64 << 20
