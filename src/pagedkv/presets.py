"""Built-in model descriptions for ``pagedkv plan``.

Each preset stands for the KV cache layers of a well-known model family (the
layer counts and head shapes of the public model configs); weights and
everything else a model has are irrelevant to the KV cache and left out.

- ``llama3-8b``: 32 full-attention layers, 8 KV heads of 128, bf16.
- ``gemma3``: 62 layers (Gemma-3-27B-like), every 6th full attention and the
  others sliding window of 1024 tokens (5:1), 16 KV heads of 128, bf16.
- ``jamba``: 32 layers (Jamba-v0.1-like), attention every 8th layer (offset
  4, 8 KV heads of 128), the others Mamba-1 with an inner size of 8192, a
  16-element state and a 4-tap convolution, bf16 states.
- ``deepseek-v3``: 61 MLA layers, one 576-element latent (512 + 64 rotary)
  per token, bf16, blocks of 64 tokens (FlashMLA's block size).
- ``deepseek-v3.2``: DeepSeek-V3.2-like sparse MLA: 61 layers, each an MLA
  cache in the fp8 DeepSeek layout (656 bytes a token) and a lightning
  indexer cache (128 fp8 values + a float32 scale = 132 bytes a token),
  blocks of 64. The device plan counts every layer; ``--host-memory``
  adds a HiSparse host tier holding the MLA caches' pages (``.attn`` layers,
  spec/host_plan.py), reported beside the device plan.
- ``swa-mla``: a sliding-window MLA model (DeepSeek-V4-like attention
  pattern, simplified): 32 layers, every 4th a full MLA layer, the others
  MLA over a 128-token window, 584 bytes a token (uint8 layout) rounded to
  576-byte pages, blocks of 64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.spec.attention_variants import SlidingWindowMLASpec
from pagedkv.spec.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["Preset", "PRESETS", "preset_names"]


@dataclass(frozen=True, slots=True)
class Preset:
    """A named model: ``build(max_model_len, block_size)`` gives its layers'
    specs; ``block_size`` ``None`` means the preset's own."""

    name: str
    description: str
    default_block_size: int
    build_layers: Callable[[int, int], dict[str, KVCacheSpec]]
    host_source_suffix: str | None = None
    """For a sparse-MLA model a HiSparse host tier can serve: the name suffix of
    its source layers (their pages live in the host pool, ``--host-memory``)."""

    def build(self, max_model_len: int, block_size: int | None = None) -> dict[str, KVCacheSpec]:
        """The specs per layer, in layer order."""
        return self.build_layers(max_model_len, block_size or self.default_block_size)

    def host_source_layers(self, specs: dict[str, KVCacheSpec]) -> list[str]:
        """The layers a HiSparse host tier keeps (none without a source suffix)."""
        suffix = self.host_source_suffix
        return [] if suffix is None else [name for name in specs if name.endswith(suffix)]


def _llama3_8b(max_model_len: int, block_size: int) -> dict[str, KVCacheSpec]:
    return {f"layers.{i}": FullAttentionSpec(block_size, 8, 128, "bfloat16") for i in range(32)}


def _gemma3(max_model_len: int, block_size: int) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(62):
        if (i + 1) % 6 == 0:
            specs[f"layers.{i}"] = FullAttentionSpec(block_size, 16, 128, "bfloat16")
        else:
            specs[f"layers.{i}"] = SlidingWindowSpec(block_size, 16, 128, "bfloat16", 1024)
    return specs


def _jamba(max_model_len: int, block_size: int) -> dict[str, KVCacheSpec]:
    d_inner, d_state, d_conv = 8192, 16, 4
    specs: dict[str, KVCacheSpec] = {}
    for i in range(32):
        if i % 8 == 4:
            specs[f"layers.{i}"] = FullAttentionSpec(block_size, 8, 128, "bfloat16")
        else:
            # Without prefix caching a Mamba layer holds one state per request,
            # whatever its length: its block spans the whole request.
            specs[f"layers.{i}"] = MambaSpec(
                max_model_len, ((d_inner, d_conv - 1), (d_inner, d_state)),
                ("bfloat16", "bfloat16"), mamba_type="mamba1")
    return specs


def _deepseek_v3(max_model_len: int, block_size: int) -> dict[str, KVCacheSpec]:
    return {f"layers.{i}": MLAAttentionSpec(block_size, 1, 576, "bfloat16") for i in range(61)}


def _deepseek_v32(max_model_len: int, block_size: int) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(61):
        specs[f"layers.{i}.attn"] = MLAAttentionSpec(block_size, 1, 576, "uint8",
                                                     cache_dtype_str="fp8_ds_mla")
        specs[f"layers.{i}.indexer"] = MLAAttentionSpec(block_size, 1, 132, "uint8")
    return specs


def _swa_mla(max_model_len: int, block_size: int) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(32):
        if i % 4 == 3:
            specs[f"layers.{i}"] = MLAAttentionSpec(block_size, 1, 584, "uint8", alignment=576)
        else:
            specs[f"layers.{i}"] = SlidingWindowMLASpec(block_size, 1, 584, "uint8", 128,
                                                        alignment=576)
    return specs


PRESETS: dict[str, Preset] = {
    preset.name: preset for preset in (
        Preset("llama3-8b", "Llama-3-8B-like: 32 full-attention layers, 8 KV heads x 128, bf16",
               16, _llama3_8b),
        Preset("gemma3", "Gemma-3-27B-like: 62 layers, 5:1 sliding-window (1024):full, "
               "16 KV heads x 128, bf16", 16, _gemma3),
        Preset("jamba", "Jamba-v0.1-like: 4 attention (8 KV heads x 128) + 28 Mamba-1 layers "
               "(8192 x 16 state, conv 4), bf16", 16, _jamba),
        Preset("deepseek-v3", "DeepSeek-V3-like: 61 MLA layers, latent 512 + rope 64, bf16",
               64, _deepseek_v3),
        Preset("deepseek-v3.2", "DeepSeek-V3.2-like sparse MLA: 61 x (fp8_ds_mla cache + "
               "132-byte indexer cache); --host-memory plans a HiSparse host tier for the "
               "MLA caches", 64, _deepseek_v32, host_source_suffix=".attn"),
        Preset("swa-mla", "sliding-window MLA: 32 layers, 3:1 SWA-MLA (128):MLA, 584-byte "
               "latents on 576-byte alignment", 64, _swa_mla),
    )
}


def preset_names() -> list[str]:
    """The built-in preset names."""
    return list(PRESETS)
