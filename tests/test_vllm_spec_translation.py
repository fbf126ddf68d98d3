"""pagedkv.vllm's translation of vLLM 0.33's newer spec kinds (no vLLM needed:
vLLM's spec objects are matched by class name; D-SPEC-10..15)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pagedkv.spec import FullAttentionSpec, MLAAttentionSpec, RSWASpec, SlidingWindowMLASpec
from pagedkv.spec.attention_variants import CircularBufferSpec, prefix_cacheable
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs
from pagedkv.vllm.config import UnsupportedVllmSpecError, translate_spec


@dataclass
class Fake:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 584
    dtype: Any = "torch.uint8"
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["extra"][name]
        except KeyError:
            raise AttributeError(name) from None


def fake(kind: str, block_size: int, **extra: Any) -> Any:
    cls = type(kind, (Fake,), {})
    return cls(block_size, extra=extra)


def test_sliding_window_mla_keeps_window_compression_and_alignment() -> None:
    spec = translate_spec(fake("SlidingWindowMLASpec", 64, sliding_window=128, alignment=576,
                               tokens_per_state=1, bounded_replay=False))
    assert isinstance(spec, SlidingWindowMLASpec)
    assert (spec.sliding_window, spec.alignment, manager_kind_for(spec)) == (128, 576, "sliding_window")
    # A bounded-replay group is managed but outside prefix caching (D-API-40).
    replayed = translate_spec(fake("SlidingWindowMLASpec", 32, sliding_window=128, bounded_replay=True))
    assert isinstance(replayed, SlidingWindowMLASpec) and replayed.bounded_replay
    assert not prefix_cacheable(replayed)


def test_compressed_mla_rswa_and_non_causal() -> None:
    mla = translate_spec(fake("MLAAttentionSpec", 128, tokens_per_state=2, alignment=576))
    assert isinstance(mla, MLAAttentionSpec) and (mla.tokens_per_state, mla.alignment) == (2, 576)
    # vLLM's fractional tokens per state (pooled encoders) has no MLA meaning here.
    pooled = translate_spec(fake("MLAAttentionSpec", 16, tokens_per_state=0.5))
    assert isinstance(pooled, MLAAttentionSpec) and pooled.tokens_per_state == 1
    rswa = translate_spec(fake("RSWASpec", 16, rswa_window=64, non_causal=False))
    assert isinstance(rswa, RSWASpec) and rswa.rswa_window == 64
    assert manager_kind_for(rswa) == "rswa"
    prefix_lm = translate_spec(fake("FullAttentionSpec", 16, non_causal=True))
    assert isinstance(prefix_lm, FullAttentionSpec) and prefix_lm.non_causal


def test_rings_translate_and_encoder_only_layers_are_refused_by_name() -> None:
    # A ring is managed outside prefix caching, one block per request (D-SPEC-18).
    ring = translate_spec(fake("CircularBufferSpec", 8, head_size_v=0))
    assert isinstance(ring, CircularBufferSpec) and ring.head_size_v == 0
    assert manager_kind_for(ring) == "circular_buffer" and not prefix_cacheable(ring)
    with pytest.raises(UnsupportedVllmSpecError, match="EncoderOnlyAttentionSpec.*D-SPEC-15"):
        translate_spec(fake("EncoderOnlyAttentionSpec", 16))


def test_uniform_type_groups_translate_layer_by_layer() -> None:
    layers = {"l0.attn": fake("MLAAttentionSpec", 64, head_size=656),
              "l0.indexer": fake("MLAAttentionSpec", 64, head_size=132)}
    spec = translate_spec(fake("UniformTypeKVCacheSpecs", 64, kv_cache_specs=layers))
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    assert [name for name, _ in spec.kv_cache_specs] == ["l0.attn", "l0.indexer"]
    assert manager_kind_for(spec) == "full_attention"
    # Layers pagedkv does not count as one uniform type (full beside R-SWA): the first layer's spec.
    mixed = {"a": fake("FullAttentionSpec", 16), "b": fake("RSWASpec", 16, rswa_window=64)}
    first = translate_spec(fake("UniformTypeKVCacheSpecs", 16, kv_cache_specs=mixed))
    assert type(first) is FullAttentionSpec
