"""KV cache spec classes: what one layer needs per block of tokens.

A spec answers three questions about one layer, and the planner asks nothing
else of it:

- ``page_size_bytes``: the bytes one block of this layer occupies, padding
  included (CFG-2..CFG-5);
- ``max_memory_usage_bytes(setting)``: the bytes one request of the longest
  allowed length can hold in this layer at once (CFG-6..CFG-10);
- ``merge(specs)``: the one spec standing for several layers put in the same
  KV cache group, or ``IncompatibleSpecError`` naming the field that differs
  (CFG-11).

Every spec is a frozen, slotted, hashable dataclass; constructors validate
their fields and raise ``InvalidConfigError`` naming the field (CFG-1). The Mamba
spec lives in ``mamba_spec``, the multi-layer ``UniformTypeKVCacheSpecs`` in
``uniform_spec``. The written specification is spec/config.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Self

from pagedkv.spec import sizing
from pagedkv.spec.errors import IncompatibleSpecError, InvalidConfigError
from pagedkv.spec.setting import ModelSetting

__all__ = [
    "DTYPE_SIZES",
    "dtype_size",
    "FP8_DS_MLA",
    "FP8_DS_MLA_BYTES_PER_TOKEN",
    "KVCacheSpec",
    "AttentionSpec",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "latent_page_bytes",
    "aligned_page_bytes",
]

DTYPE_SIZES: Final[dict[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Bytes per element of each dtype name a spec may use."""

FP8_DS_MLA: Final = "fp8_ds_mla"
"""The DeepSeek sparse-MLA fp8 cache layout (``MLAAttentionSpec.cache_dtype_str``)."""

FP8_DS_MLA_BYTES_PER_TOKEN: Final = 656
"""Bytes per token of the fp8 DeepSeek layout: 512 fp8 latent values, 4
float32 scales (one per 128 values) and 64 bf16 rotary values."""

_FP8_DS_MLA_HEAD_SIZE: Final = 576  # 512 latent + 64 rotary


def dtype_size(dtype: str) -> int:
    """Bytes per element of ``dtype``; raises on an unknown name."""
    try:
        return DTYPE_SIZES[dtype]
    except (KeyError, TypeError):
        raise InvalidConfigError(
            f"dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}") from None


def _positive(owner: object, name: str, value: object) -> None:
    if type(value) is not int or value <= 0:
        raise InvalidConfigError(
            f"{type(owner).__name__}.{name} must be a positive int, got {value!r}")


def _optional_positive(owner: object, name: str, value: object) -> None:
    if value is not None:
        _positive(owner, name, value)


def _check_dtype(owner: object, name: str, value: object) -> None:
    if not isinstance(value, str) or value not in DTYPE_SIZES:
        raise InvalidConfigError(
            f"{type(owner).__name__}.{name} must be one of {sorted(DTYPE_SIZES)}, got {value!r}")


def _no_context_parallelism(spec: KVCacheSpec, setting: ModelSetting) -> None:
    """Layers that drop or recycle blocks do not support context parallelism."""
    for name in ("dcp_world_size", "pcp_world_size"):
        if getattr(setting, name) != 1:
            raise InvalidConfigError(
                f"ModelSetting.{name} must be 1 for {type(spec).__name__} layers, "
                f"got {getattr(setting, name)}")


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """A layer's KV cache needs, per block of ``block_size`` tokens (abstract)."""

    block_size: int

    def __post_init__(self) -> None:
        _positive(self, "block_size", self.block_size)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes one block's data needs, before padding."""
        raise NotImplementedError(f"{type(self).__name__} does not define its page size")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer occupies in memory, padding included."""
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """The most bytes one request can hold in this layer at once."""
        raise NotImplementedError(f"{type(self).__name__} does not define its memory usage")

    def token_slot_key(self) -> object:
        """What, besides the manager kind, decides how many token slots a
        request needs in this layer (a window size, a chunk size...). Layers
        of one manager kind with equal keys are of a uniform type (CFG-13)."""
        return None

    def copy_with_new_block_size(self, block_size: int) -> Self:
        """This spec with ``block_size`` replaced (validated again)."""
        return dataclasses.replace(self, block_size=block_size)

    @classmethod
    def _same_type(cls, specs: Sequence[KVCacheSpec]) -> list[Self]:
        if len(specs) == 0:
            raise InvalidConfigError(f"{cls.__name__}.merge needs at least one spec, got none")
        typed: list[Self] = []
        for index, spec in enumerate(specs):
            if type(spec) is not cls or not isinstance(spec, cls):
                raise IncompatibleSpecError(
                    f"cannot merge specs: field 'type' differs: specs[{index}] is "
                    f"{type(spec).__name__}, expected {cls.__name__}")
            typed.append(spec)
        return typed

    @classmethod
    def _require_equal(cls, specs: Sequence[Self], ignore: tuple[str, ...] = ()) -> None:
        first = specs[0]
        for index, spec in enumerate(specs[1:], start=1):
            for f in dataclasses.fields(first):
                if f.name in ignore:
                    continue
                mine, theirs = getattr(first, f.name), getattr(spec, f.name)
                if mine != theirs:
                    raise IncompatibleSpecError(
                        f"cannot merge {cls.__name__} specs: field {f.name!r} differs: "
                        f"specs[0] has {mine!r}, specs[{index}] has {theirs!r}")

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        """One spec for the layers of one group: they must all be this exact
        type and equal, field by field (CFG-11).

        Raises ``IncompatibleSpecError`` naming the first differing field, or
        ``InvalidConfigError`` for an empty list.
        """
        typed = cls._same_type(specs)
        cls._require_equal(typed)
        return typed[0]


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer: keys and values of ``num_kv_heads`` heads of
    ``head_size`` elements of ``dtype``.

    ``page_size_padded`` (keyword only) makes each page that many bytes,
    at least the real page, so that a hybrid model's pages match (CFG-15).
    """

    num_kv_heads: int
    head_size: int
    dtype: str
    page_size_padded: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _positive(self, "num_kv_heads", self.num_kv_heads)
        _positive(self, "head_size", self.head_size)
        _check_dtype(self, "dtype", self.dtype)
        self._check_padding()

    def _check_padding(self) -> None:
        if self.page_size_padded is None:
            return
        _positive(self, "page_size_padded", self.page_size_padded)
        if self.page_size_padded < self.real_page_size_bytes:
            raise InvalidConfigError(
                f"{type(self).__name__}.page_size_padded must be >= the real page size "
                f"{self.real_page_size_bytes}, got {self.page_size_padded}")

    @property
    def real_page_size_bytes(self) -> int:
        """``2 * block_size * num_kv_heads * head_size * dtype size`` (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """The padded page when ``page_size_padded`` is set, else the real one (CFG-2)."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: every token attends to every earlier one, so a
    request keeps a slot for each of its tokens until it finishes.

    ``head_size_v`` is the value head size when it differs from the key's.
    ``sliding_window`` / ``attention_chunk_size`` record a layer's own window
    when the hybrid manager is disabled: the manager then allocates for every
    token, as for full attention, while the model still computes over the
    window (``unify_hybrid_kv_cache_specs``).

    ``non_causal`` (keyword only) marks a layer that attends both ways (a
    prefix LM). It changes neither the page nor the manager's block
    accounting; engines read it to turn off chunked prefill and prefix
    caching for such models (D-SPEC-11). Merged groups are non-causal when
    any layer is.
    """

    head_size_v: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        for name in ("head_size_v", "sliding_window", "attention_chunk_size"):
            _optional_positive(self, name, getattr(self, name))
        if type(self.non_causal) is not bool:
            raise InvalidConfigError(
                f"{type(self).__name__}.non_causal must be a bool, got {self.non_causal!r}")
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise InvalidConfigError(
                f"{type(self).__name__} may record sliding_window or attention_chunk_size, "
                f"not both (got {self.sliding_window} and {self.attention_chunk_size})")

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * num_kv_heads * (head_size + head_size_v) * dtype size``."""
        v = self.head_size if self.head_size_v is None else self.head_size_v
        return self.block_size * self.num_kv_heads * (self.head_size + v) * dtype_size(self.dtype)

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """``cdiv(cdiv(max_model_len, dcp * pcp), block_size)`` pages (CFG-6)."""
        blocks = sizing.full_attention_blocks(
            setting.max_model_len, self.block_size, setting.dcp_world_size, setting.pcp_world_size)
        return blocks * self.page_size_bytes

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        """Full-attention layers merge when every field but the recorded
        windows is equal; the recorded windows must agree where set, and the
        merged spec records the common one (CFG-11).

        Example: ``merge([full(sliding_window=None), full(sliding_window=1024)])``
        is ``full(sliding_window=1024)``; adding ``full(sliding_window=512)``
        raises, naming ``sliding_window``.
        """
        typed = cls._same_type(specs)
        windows = ("sliding_window", "attention_chunk_size")
        cls._require_equal(typed, ignore=(*windows, "non_causal"))
        merged: dict[str, int | None] = {}
        for name in windows:
            values = sorted({v for v in (getattr(s, name) for s in typed) if v is not None})
            if len(values) > 1:
                raise IncompatibleSpecError(
                    f"cannot merge {cls.__name__} specs: field {name!r} differs: "
                    f"layers record {values}")
            merged[name] = values[0] if values else None
        if merged["sliding_window"] is not None and merged["attention_chunk_size"] is not None:
            raise IncompatibleSpecError(
                f"cannot merge {cls.__name__} specs: field 'attention_chunk_size' is set "
                f"on some layers and 'sliding_window' on others")
        return dataclasses.replace(
            typed[0], sliding_window=merged["sliding_window"],
            attention_chunk_size=merged["attention_chunk_size"],
            non_causal=any(s.non_causal for s in typed))


@dataclass(frozen=True, slots=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek): one compressed latent vector
    per token serves as both key and value, so pages hold no K/V doubling.

    ``cache_dtype_str`` names a special cache layout; ``"fp8_ds_mla"`` stores
    656 bytes per token (CFG-4) and needs ``num_kv_heads == 1`` and
    ``head_size == 576``.

    Compressed MLA (DeepSeek-V4-like, keyword only): ``tokens_per_state``
    tokens share one stored latent, so a block of ``block_size`` tokens holds
    ``block_size // tokens_per_state`` latents; ``alignment`` rounds the page
    up to a multiple of that many bytes (CFG-4a, D-SPEC-12).
    """

    cache_dtype_str: str | None = None
    tokens_per_state: int = field(default=1, kw_only=True)
    alignment: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_compression(self, self.tokens_per_state, self.alignment)
        FullAttentionSpec.__post_init__(self)
        if self.head_size_v is not None:
            raise InvalidConfigError(
                f"MLAAttentionSpec.head_size_v must be None (no separate values), "
                f"got {self.head_size_v!r}")
        if self.cache_dtype_str is not None and not isinstance(self.cache_dtype_str, str):
            raise InvalidConfigError(
                f"MLAAttentionSpec.cache_dtype_str must be a str or None, got {self.cache_dtype_str!r}")
        if self.cache_dtype_str == FP8_DS_MLA:
            if self.num_kv_heads != 1:
                raise InvalidConfigError(
                    f"MLAAttentionSpec.num_kv_heads must be 1 with cache_dtype_str "
                    f"{FP8_DS_MLA!r}, got {self.num_kv_heads}")
            if self.head_size != _FP8_DS_MLA_HEAD_SIZE:
                raise InvalidConfigError(
                    f"MLAAttentionSpec.head_size must be {_FP8_DS_MLA_HEAD_SIZE} with "
                    f"cache_dtype_str {FP8_DS_MLA!r}, got {self.head_size}")

    @property
    def real_page_size_bytes(self) -> int:
        """``states * 656`` for fp8_ds_mla, else
        ``states * num_kv_heads * head_size * dtype size``, with
        ``states = block_size // tokens_per_state`` (CFG-4, CFG-4a)."""
        return latent_page_bytes(self)

    @property
    def page_size_bytes(self) -> int:
        """The padded page if set, else the real page rounded up to ``alignment``."""
        return aligned_page_bytes(self)


def _check_compression(spec: KVCacheSpec, tokens_per_state: int, alignment: int | None) -> None:
    """``tokens_per_state`` a positive int at most ``block_size``; ``alignment`` positive or None."""
    _positive(spec, "tokens_per_state", tokens_per_state)
    _optional_positive(spec, "alignment", alignment)
    if tokens_per_state > spec.block_size:
        raise InvalidConfigError(
            f"{type(spec).__name__}.tokens_per_state must be <= block_size "
            f"{spec.block_size}, got {tokens_per_state}")


def latent_page_bytes(spec: AttentionSpec) -> int:
    """Bytes of one block of latents (MLA layouts, no K/V doubling):
    ``block_size // tokens_per_state`` stored states of ``num_kv_heads``
    latents each; the fp8 DeepSeek layout stores 656 bytes per state."""
    states = spec.block_size // int(getattr(spec, "tokens_per_state", 1))
    if getattr(spec, "cache_dtype_str", None) == FP8_DS_MLA:
        return states * FP8_DS_MLA_BYTES_PER_TOKEN
    return states * spec.num_kv_heads * spec.head_size * dtype_size(spec.dtype)


def aligned_page_bytes(spec: AttentionSpec) -> int:
    """``page_size_padded`` when set, else the real page rounded up to a
    multiple of the spec's ``alignment`` (none: the real page)."""
    if spec.page_size_padded is not None:
        return spec.page_size_padded
    real = spec.real_page_size_bytes
    alignment: int | None = getattr(spec, "alignment", None)
    if alignment is None:
        return real
    return sizing.cdiv(real, alignment) * alignment


@dataclass(frozen=True, slots=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` attention-sink tokens whose KV every
    request reads; the sink blocks are reserved in the pool once.

    Its memory usage counts the sink blocks on top of the request's own
    (CFG-6), so the memory check covers one request plus the sink.
    """

    sink_len: int | None = None

    def __post_init__(self) -> None:
        FullAttentionSpec.__post_init__(self)
        _optional_positive(self, "sink_len", self.sink_len)

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """Full attention's pages plus ``cdiv(sink_len, block_size)`` sink pages."""
        sink_blocks = 0 if self.sink_len is None else sizing.cdiv(self.sink_len, self.block_size)
        return FullAttentionSpec.max_memory_usage_bytes(self, setting) + sink_blocks * self.page_size_bytes

    def token_slot_key(self) -> object:
        return self.sink_len


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token attends to the ``sliding_window``
    tokens ending at itself, so blocks wholly before the window are freed.

    Example, ``sliding_window=4`` with 7 tokens computed::

        tokens   0 1 2 3 4 5 6 | 7
                 skipped  |--window--|   (the next token, 7, reads 4..7)

    Tokens 0..3 are never read again; their blocks return to the pool.
    """

    sliding_window: int
    # Tokens kept below the window but never attended: multi-module
    # speculative decoding re-prefills the last ones, so their blocks are
    # released that much later (D-SWA-13). Hits still need only the window.
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        _positive(self, "sliding_window", self.sliding_window)
        if type(self.extra_retained_tokens) is not int or self.extra_retained_tokens < 0:
            raise InvalidConfigError(
                f"SlidingWindowSpec.extra_retained_tokens must be a non-negative int, "
                f"got {self.extra_retained_tokens!r}")

    @property
    def retained_window(self) -> int:
        """Tokens whose blocks are kept: the window plus the extra retained ones."""
        return self.sliding_window + self.extra_retained_tokens

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """The per-request cap, in blocks (CFG-7): what startup sizing counts
        per request and what the manager reserves at admission, so that a
        request admitted at startup is admitted at run time too.

        ``cdiv(min(sliding_window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1``
        """
        _positive(self, "max_num_batched_tokens", max_num_batched_tokens)
        _positive(self, "max_model_len", max_model_len)
        return sizing.sliding_window_admission_blocks(
            self.retained_window, max_num_batched_tokens, max_model_len, self.block_size)

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """The admission cap in pages (CFG-7); no context parallelism."""
        return _admission_cap_bytes(self, setting)

    def token_slot_key(self) -> object:
        return self.sliding_window if not self.extra_retained_tokens else (
            self.sliding_window, self.extra_retained_tokens)


def _admission_cap_bytes(spec: SlidingWindowSpec | ChunkedLocalAttentionSpec, setting: ModelSetting) -> int:
    """Bytes of a windowed spec's per-request admission cap."""
    _no_context_parallelism(spec, setting)
    blocks = spec.max_admission_blocks_per_request(setting.max_num_batched_tokens, setting.max_model_len)
    return blocks * spec.page_size_bytes


@dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4): the sequence is cut into chunks of
    ``attention_chunk_size`` tokens and a token attends only within its chunk.

    Example, chunk size 4 with 9 tokens computed::

        tokens   0 1 2 3 | 4 5 6 7 | 8 | 9
                 skipped   skipped  |chunk of 9|

    Blocks of finished chunks are never read again.
    """

    attention_chunk_size: int

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        _positive(self, "attention_chunk_size", self.attention_chunk_size)

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """The per-request cap, in blocks (CFG-8):
        ``cdiv(min(attention_chunk_size + max_num_batched_tokens, max_model_len), block_size)``."""
        _positive(self, "max_num_batched_tokens", max_num_batched_tokens)
        _positive(self, "max_model_len", max_model_len)
        return sizing.chunked_local_admission_blocks(
            self.attention_chunk_size, max_num_batched_tokens, max_model_len, self.block_size)

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """The admission cap in pages (CFG-8); no context parallelism."""
        return _admission_cap_bytes(self, setting)

    def token_slot_key(self) -> object:
        return self.attention_chunk_size


@dataclass(frozen=True, slots=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross-attention of an encoder-decoder model: the decoder reads the
    encoder's keys and values, so a request holds its encoder input's slots,
    however long the decoded output grows."""

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """``cdiv(max encoder input tokens, block_size)`` pages (CFG-10)."""
        return sizing.cdiv(setting.encoder_tokens, self.block_size) * self.page_size_bytes
