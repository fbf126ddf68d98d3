"""Which single-type manager serves each kind of KV cache spec.

The registry maps a spec *type* to a manager *kind*: the name of the
single-type manager (full attention, sliding window...) a coordinator builds
for a group of that spec. Implementations (reference, optimized) map kinds to
their own manager classes; engines with their own spec types register them
here with ``register_kv_cache_spec``. Lookup follows the spec's class
hierarchy, so a subclass of a registered type is served by its parent's kind
unless registered itself (CFG-13).
"""

from __future__ import annotations

from typing import Final

from pagedkv.spec.attention_variants import (
    CircularBufferSpec,
    EncoderOnlyAttentionSpec,
    RSWASpec,
    SlidingWindowMLASpec,
)
from pagedkv.spec.errors import InvalidConfigError
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

__all__ = [
    "BUILTIN_MANAGER_KINDS",
    "register_kv_cache_spec",
    "manager_kind_for",
    "registered_spec_types",
]

BUILTIN_MANAGER_KINDS: Final = (
    "full_attention",
    "sliding_window",
    "chunked_local",
    "mamba",
    "cross_attention",
    "sink_full_attention",
    "circular_buffer",
    "rswa",
)

_REGISTRY: dict[type[KVCacheSpec], str] = {
    FullAttentionSpec: "full_attention",
    MLAAttentionSpec: "full_attention",
    SlidingWindowSpec: "sliding_window",
    ChunkedLocalAttentionSpec: "chunked_local",
    MambaSpec: "mamba",
    CrossAttentionSpec: "cross_attention",
    SinkFullAttentionSpec: "sink_full_attention",
}
# vLLM 0.33's newer kinds (spec/attention_variants.py): sliding-window MLA is
# served by the sliding-window manager, as vLLM registers it; R-SWA (full
# attention that releases its gap blocks, D-SPEC-19), rings and encoder-only
# layers have kinds of their own.
_REGISTRY.update({
    SlidingWindowMLASpec: "sliding_window",
    RSWASpec: "rswa",
    CircularBufferSpec: "circular_buffer",
    EncoderOnlyAttentionSpec: "encoder_only",
})


def register_kv_cache_spec(spec_type: type[KVCacheSpec], manager_kind: str, *,
                           replace: bool = False) -> None:
    """Serve layers of ``spec_type`` (and its unregistered subclasses) with
    the manager kind ``manager_kind``.

    Re-registering a type under another kind raises ``InvalidConfigError``
    unless ``replace=True``; registering it again under the same kind is a
    no-op.
    """
    if not isinstance(spec_type, type) or not issubclass(spec_type, KVCacheSpec):
        raise InvalidConfigError(
            f"register_kv_cache_spec: spec_type must be a KVCacheSpec subclass, got {spec_type!r}")
    if not isinstance(manager_kind, str) or not manager_kind:
        raise InvalidConfigError(
            f"register_kv_cache_spec: manager_kind must be a non-empty str, got {manager_kind!r}")
    current = _REGISTRY.get(spec_type)
    if current is not None and current != manager_kind and not replace:
        raise InvalidConfigError(
            f"register_kv_cache_spec: {spec_type.__name__} is already served by {current!r}; "
            f"pass replace=True to serve it by {manager_kind!r}")
    _REGISTRY[spec_type] = manager_kind


def manager_kind_for(spec: KVCacheSpec) -> str:
    """The manager kind serving ``spec``: the kind of the nearest registered
    class in its hierarchy; for ``UniformTypeKVCacheSpecs``, its layers' kind.

    Raises ``InvalidConfigError`` when no class of the hierarchy is registered.
    """
    # A uniform-type group (spec/uniform_spec.py) answers through its layers; it
    # is recognised by its field, not its class, because that module imports this one.
    layers = getattr(spec, "kv_cache_specs", None)
    if layers is not None:
        return manager_kind_for(layers[0][1])
    for cls in type(spec).__mro__:
        kind = _REGISTRY.get(cls)
        if kind is not None:
            return kind
    raise InvalidConfigError(
        f"no manager kind is registered for spec type {type(spec).__name__}; "
        f"call register_kv_cache_spec({type(spec).__name__}, kind) first")


def registered_spec_types() -> dict[type[KVCacheSpec], str]:
    """A copy of the registry: spec type -> manager kind."""
    return dict(_REGISTRY)
