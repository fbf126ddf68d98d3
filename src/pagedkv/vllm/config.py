"""vLLM's ``KVCacheConfig`` and spec objects, translated into pagedkv's.

The manager's behaviour depends only on each group's spec *kind* and its
token geometry (block size, window, chunk, Mamba cache mode, speculative
blocks); page sizes and dtypes matter to planning, not to block management.
So the translation keeps the geometry exactly and maps a dtype pagedkv does
not know to ``float16`` (the page size is then not vLLM's; nothing in the
manager reads it). A spec kind pagedkv has no manager for raises
:class:`UnsupportedVllmSpecError` naming it: encoder-only layers, which vLLM
itself never hands to a manager (D-SPEC-15). Rings (``CircularBufferSpec``)
and bounded-replay sliding-window MLA are managed outside prefix caching
(PFX-1, D-API-40, D-SPEC-18).
"""

from __future__ import annotations

from typing import Any

from pagedkv.spec.attention_variants import CircularBufferSpec, RSWASpec, SlidingWindowMLASpec
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import (
    DTYPE_SIZES,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

__all__ = ["UnsupportedVllmSpecError", "translate_spec", "translate_config", "group_block_size"]


class UnsupportedVllmSpecError(InvalidConfigError):
    """A vLLM KV cache spec kind pagedkv does not manage (yet)."""


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _dtype(value: Any) -> str:
    name = str(value).removeprefix("torch.")
    return name if name in DTYPE_SIZES else "float16"


def _attention_fields(spec: Any) -> dict[str, Any]:
    return {"block_size": spec.block_size, "num_kv_heads": max(1, spec.num_kv_heads),
            "head_size": max(1, spec.head_size), "dtype": _dtype(spec.dtype)}


def translate_spec(spec: Any, block_size: int | None = None) -> KVCacheSpec:
    """pagedkv's spec for one vLLM spec object (by class name, most derived first).

    ``block_size`` overrides the spec's (vLLM scales block sizes by the
    context-parallel world sizes itself; pagedkv does that in the manager).
    """
    kind = type(spec).__name__
    fields = _attention_fields(spec) if hasattr(spec, "num_kv_heads") else {}
    if block_size is not None and fields:
        fields["block_size"] = block_size
    if kind == "UniformTypeKVCacheSpecs":
        return _uniform_type(spec, block_size)
    if kind in _NOT_MANAGED:
        raise UnsupportedVllmSpecError(
            f"pagedkv has no manager for vLLM's {kind}: {_NOT_MANAGED[kind]} (KV cache group spec "
            f"{spec!r})")
    if kind == "CircularBufferSpec":
        # A ring: one block per request, outside prefix caching (RING-1, D-SPEC-18).
        head_size_v = getattr(spec, "head_size_v", None)
        return CircularBufferSpec(**fields, head_size_v=int(head_size_v) if type(head_size_v) is int
                                  and head_size_v >= 0 else None)
    if kind == "SlidingWindowMLASpec":
        # A bounded-replay group takes no part in prefix caching (PFX-1, D-API-40).
        return SlidingWindowMLASpec(**fields, sliding_window=spec.sliding_window,
                                    bounded_replay=bool(getattr(spec, "bounded_replay", False)),
                                    **_compression(spec, fields["block_size"]))
    if kind == "SlidingWindowSpec":
        return SlidingWindowSpec(**fields, sliding_window=spec.sliding_window,
                                 extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0))
    if kind == "ChunkedLocalAttentionSpec":
        return ChunkedLocalAttentionSpec(**fields, attention_chunk_size=spec.attention_chunk_size)
    if kind == "CrossAttentionSpec":
        return CrossAttentionSpec(**fields)
    if kind == "SinkFullAttentionSpec":
        return SinkFullAttentionSpec(**fields, sink_len=spec.sink_len)
    if kind in ("MLAAttentionSpec", "HiddenStateCacheSpec"):
        return MLAAttentionSpec(**fields, **_compression(spec, fields["block_size"]))
    if kind in ("FullAttentionSpec", "RSWASpec"):
        window = getattr(spec, "sliding_window", None)
        chunk = getattr(spec, "attention_chunk_size", None)
        common: dict[str, Any] = dict(
            fields, sliding_window=window, attention_chunk_size=None if window is not None else chunk,
            non_causal=bool(getattr(spec, "non_causal", False)))
        if kind == "RSWASpec":
            return RSWASpec(**common, rswa_window=max(1, int(spec.rswa_window)))
        return FullAttentionSpec(**common)
    if kind == "MambaSpec":
        # vLLM accepts one shape given bare, ``shapes=(1, 1)``, as well as a tuple of shapes.
        raw = tuple(spec.shapes)
        raw = (raw,) if raw and all(isinstance(d, int) for d in raw) else raw
        shapes = tuple(tuple(int(d) for d in shape) or (1,) for shape in raw) or ((1,),)
        dtypes = tuple(_dtype(d) for d in spec.dtypes) or ("float16",)
        return MambaSpec(block_size if block_size is not None else spec.block_size,
                         shapes=shapes, dtypes=dtypes[:len(shapes)] + ("float16",) * (
                             len(shapes) - len(dtypes)),
                         mamba_type=str(getattr(spec, "mamba_type", "mamba2")) or "mamba2",
                         mamba_cache_mode=str(getattr(spec, "mamba_cache_mode", "none")),
                         num_speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0)),
                         num_prefill_checkpoint_blocks=int(
                             getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0),
                         prefill_checkpoint_alignment=_optional_int(
                             getattr(spec, "prefill_checkpoint_alignment", None)))
    raise UnsupportedVllmSpecError(
        f"pagedkv has no manager for vLLM's {kind} (KV cache group spec {spec!r})")


def _uniform_type(spec: Any, block_size: int | None) -> KVCacheSpec:
    """vLLM's multi-layer group spec: each layer translated. pagedkv's
    ``UniformTypeKVCacheSpecs`` when its stricter uniform-type rule holds
    (CFG-13: one manager kind, equal token-slot keys); otherwise the first
    layer's spec, which has the same manager kind and token geometry as the
    group's vLLM manager uses (vLLM picks the manager from the first layer)."""
    size = int(spec.block_size) if block_size is None else block_size
    layers = tuple((str(name), translate_spec(layer, size))
                   for name, layer in spec.kv_cache_specs.items())
    if not layers:
        raise UnsupportedVllmSpecError(f"vLLM's UniformTypeKVCacheSpecs holds no layer ({spec!r})")
    try:
        return UniformTypeKVCacheSpecs(size, layers)
    except InvalidConfigError:
        return layers[0][1]


_NOT_MANAGED: dict[str, str] = {
    "EncoderOnlyAttentionSpec": "encoder-only layers keep no KV cache between steps; vLLM 0.33 "
                                "adds them to the workers' config only, never to the "
                                "scheduler's manager (D-SPEC-15)",
}


def _compression(spec: Any, block_size: int) -> dict[str, Any]:
    """The compressed-MLA fields pagedkv keeps: an integral ``tokens_per_state``
    (vLLM's fractional ones, for pooled encoders, change no block geometry)
    and ``alignment``."""
    per_state = getattr(spec, "tokens_per_state", 1)
    tokens_per_state = per_state if type(per_state) is int and 1 <= per_state <= block_size else 1
    alignment = getattr(spec, "alignment", None)
    return {"tokens_per_state": tokens_per_state,
            "alignment": alignment if type(alignment) is int and alignment > 0 else None}


def group_block_size(spec: Any, dcp_world_size: int) -> int:
    """A group's block size in tokens as vLLM 0.33 counts it under decode context
    parallelism: scaled by the DCP world size for DCP-sharded specs only (D-VLLM-7)."""
    scale = dcp_world_size if getattr(spec, "dcp_sharded", True) else 1
    return int(spec.block_size) * scale


def translate_config(config: Any, dcp_world_size: int = 1) -> KVCacheConfig:
    """pagedkv's ``KVCacheConfig`` for vLLM's (groups in order, same layer names, no
    tensors), block sizes already scaled for context parallelism (D-VLLM-7)."""
    groups = tuple(
        KVCacheGroupSpec(tuple(group.layer_names), translate_spec(
            group.kv_cache_spec, group_block_size(group.kv_cache_spec, dcp_world_size)),
            is_eagle_group=bool(getattr(group, "is_eagle_group", False)))
        for group in config.kv_cache_groups)
    # The tensors back the engine's memory; the manager never reads them.
    return KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=(), kv_cache_groups=groups)
