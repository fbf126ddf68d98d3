"""Model files for ``pagedkv plan``: a model's KV cache layers in JSON or YAML.

Format (YAML shown; JSON has the same structure)::

    name: my-model            # optional
    block_size: 16            # default block size of every layer (default 16)
    dtype: bfloat16           # default dtype of every attention layer
    layers:                   # in model order
      - type: full_attention  # see LAYER_TYPES
        count: 30             # this many identical layers (default 1)
        num_kv_heads: 8
        head_size: 128
      - type: sliding_window
        num_kv_heads: 8
        head_size: 128
        sliding_window: 4096
        name: layers.30       # optional, only with count 1

Layers are named ``layers.<index>`` in order unless they give a ``name``.
Every other key of a layer is a field of its spec class. A Mamba layer
without ``block_size`` spans the whole request (``max_model_len`` tokens), as
an engine without Mamba prefix caching does. Any mistake raises
``ModelFileError`` naming the file, the layer and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

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

__all__ = ["ModelFileError", "ModelDescription", "LAYER_TYPES", "load_model_file", "parse_model"]

_ATTENTION: Final = ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_padded")

LAYER_TYPES: Final[dict[str, tuple[type[KVCacheSpec], tuple[str, ...]]]] = {
    "full_attention": (FullAttentionSpec, _ATTENTION + ("head_size_v", "sliding_window",
                                                        "attention_chunk_size")),
    "mla_attention": (MLAAttentionSpec, _ATTENTION + ("cache_dtype_str",)),
    "sink_full_attention": (SinkFullAttentionSpec, _ATTENTION + ("head_size_v", "sink_len")),
    "sliding_window": (SlidingWindowSpec, _ATTENTION + ("sliding_window",)),
    "chunked_local": (ChunkedLocalAttentionSpec, _ATTENTION + ("attention_chunk_size",)),
    "cross_attention": (CrossAttentionSpec, _ATTENTION),
    "mamba": (MambaSpec, ("block_size", "shapes", "dtypes", "mamba_type", "mamba_cache_mode",
                          "num_speculative_blocks", "page_size_padded")),
}
"""Layer ``type`` -> (spec class, the fields a layer of that type may give)."""

_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    "mamba": ("shapes", "dtypes"),
    "sliding_window": ("num_kv_heads", "head_size", "sliding_window"),
    "chunked_local": ("num_kv_heads", "head_size", "attention_chunk_size"),
}
_TOP_LEVEL: Final = ("name", "block_size", "dtype", "layers")


class ModelFileError(InvalidConfigError):
    """A model file is unreadable or malformed; the message names the file
    and, where it applies, the layer and field."""


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """A model's name and its layers' specs, in order."""

    name: str
    specs: dict[str, KVCacheSpec]


def load_model_file(path: str | Path, max_model_len: int) -> ModelDescription:
    """Read a JSON (``.json``) or YAML (anything else) model file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read the model file: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            data: object = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ImportError:
        raise ModelFileError(f"{path}: YAML model files need PyYAML (pip install pyyaml)") from None
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError's parse errors
        raise ModelFileError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from None
    except Exception as exc:  # yaml.YAMLError is not a ValueError
        raise ModelFileError(f"{path}: not valid YAML: {exc}") from None
    return parse_model(data, max_model_len, source=str(path))


def parse_model(data: object, max_model_len: int, source: str = "<model>") -> ModelDescription:
    """Build a model description from parsed JSON/YAML data."""
    def fail(where: str, message: str) -> ModelFileError:
        return ModelFileError(f"{source}: {where}: {message}")

    if not isinstance(data, Mapping):
        raise fail("top level", f"must be a mapping with a 'layers' list, got {type(data).__name__}")
    for key in data:
        if key not in _TOP_LEVEL:
            raise fail(f"field {key!r}", f"unknown top-level field; expected one of {list(_TOP_LEVEL)}")
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str):
        raise fail("field 'name'", f"must be a string, got {name!r}")
    defaults = {"block_size": data.get("block_size", 16), "dtype": data.get("dtype", "bfloat16")}
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise fail("field 'layers'", f"must be a non-empty list of layers, got {layers!r}")
    specs: dict[str, KVCacheSpec] = {}
    for index, layer in enumerate(layers):
        where = f"layers[{index}]"
        if not isinstance(layer, Mapping):
            raise fail(where, f"must be a mapping, got {layer!r}")
        layer_type = layer.get("type")
        if layer_type not in LAYER_TYPES:
            raise fail(f"{where}.type", f"must be one of {list(LAYER_TYPES)}, got {layer_type!r}")
        spec_class, allowed = LAYER_TYPES[layer_type]
        count = layer.get("count", 1)
        if type(count) is not int or count < 1:
            raise fail(f"{where}.count", f"must be a positive int, got {count!r}")
        layer_name = layer.get("name")
        if layer_name is not None and (not isinstance(layer_name, str) or not layer_name or count != 1):
            raise fail(f"{where}.name", f"must be a non-empty string on a layer with count 1, "
                                        f"got {layer_name!r} with count {count}")
        kwargs: dict[str, Any] = {}
        for key, value in layer.items():
            if key in ("type", "count", "name"):
                continue
            if key not in allowed:
                raise fail(f"{where}.{key}", f"unknown field for type {layer_type!r}; "
                                             f"expected one of {list(allowed)}")
            kwargs[key] = value
        for key in _REQUIRED.get(layer_type, ("num_kv_heads", "head_size")):
            if key not in kwargs:
                raise fail(f"{where}.{key}", f"missing; a {layer_type!r} layer needs it")
        if layer_type == "mamba":
            mode = kwargs.get("mamba_cache_mode", "none")
            kwargs.setdefault("block_size", defaults["block_size"] if mode == "all" else max_model_len)
            for key in ("shapes", "dtypes"):
                value = kwargs[key]
                if not isinstance(value, list):
                    raise fail(f"{where}.{key}", f"must be a list, got {value!r}")
            kwargs["shapes"] = tuple(tuple(s) if isinstance(s, list) else s for s in kwargs["shapes"])
            kwargs["dtypes"] = tuple(kwargs["dtypes"])
        else:
            for key, value in defaults.items():
                kwargs.setdefault(key, value)
        try:
            spec = spec_class(**kwargs)
        except InvalidConfigError as exc:
            raise fail(where, str(exc)) from None
        except TypeError as exc:
            raise fail(where, f"bad fields for type {layer_type!r}: {exc}") from None
        for _ in range(count):
            full_name = layer_name or f"layers.{len(specs)}"
            if full_name in specs:
                raise fail(f"{where}.name", f"layer name {full_name!r} is used twice")
            specs[full_name] = spec
    return ModelDescription(name, specs)
