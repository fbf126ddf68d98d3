"""The attention spec kinds vLLM 0.33 added beyond the seeds (spec/config.md,
CFG-4a, CFG-9a..CFG-9d).

- ``SlidingWindowMLASpec``: a sliding window over MLA latents (DeepSeek-V4's
  SWA layers). Page as MLA (no K/V doubling, compression, alignment); the
  window and the memory formula as sliding window. Served by the
  sliding-window manager, as in vLLM. ``bounded_replay`` layers are not
  prefix cached (``prefix_cacheable`` false).
- ``CircularBufferSpec``: one ring block per request (a compressor's open
  token group). Memory: one page per request, whatever the length; never
  prefix cached. Manager kind ``circular_buffer``: one block per request
  (spec/managers.md §7a, RING-1, D-SPEC-18).
- ``RSWASpec``: reference sliding window (R-SWA): the prompt stays visible,
  only the last ``rswa_window`` generated tokens are read. Memory as full
  attention (prompt + window never exceeds ``max_model_len``). Manager kind
  ``rswa``: full attention that releases the gap between prompt and window
  (spec/managers.md §2a, RSWA-1, D-SPEC-19).
- ``EncoderOnlyAttentionSpec``: an encoder-only layer (BERT-like) keeps no
  KV cache between steps: memory 0, no manager; the planner leaves such
  layers out of the groups (D-SPEC-15).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    _check_compression,
    _positive,
    aligned_page_bytes,
    dtype_size,
    latent_page_bytes,
)
from pagedkv.spec.setting import ModelSetting

__all__ = [
    "SlidingWindowMLASpec",
    "CircularBufferSpec",
    "RSWASpec",
    "EncoderOnlyAttentionSpec",
    "prefix_cacheable",
]


@dataclass(frozen=True, slots=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention over MLA latents.

    Example: ``block_size=64``, one 584-byte latent per token (uint8,
    ``head_size=584``), ``alignment=576``: the real page is 64 * 584 =
    37,376 bytes, rounded up to 65 * 576 = 37,440.
    """

    cache_dtype_str: str | None = field(default=None, kw_only=True)
    tokens_per_state: int = field(default=1, kw_only=True)
    alignment: int | None = field(default=None, kw_only=True)
    bounded_replay: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_compression(self, self.tokens_per_state, self.alignment)
        if type(self.bounded_replay) is not bool:
            raise InvalidConfigError(
                f"SlidingWindowMLASpec.bounded_replay must be a bool, got {self.bounded_replay!r}")
        SlidingWindowSpec.__post_init__(self)

    @property
    def real_page_size_bytes(self) -> int:
        """As MLA: ``block_size // tokens_per_state`` latents (CFG-4a)."""
        return latent_page_bytes(self)

    @property
    def page_size_bytes(self) -> int:
        return aligned_page_bytes(self)

    @property
    def prefix_cacheable(self) -> bool:
        """Bounded-replay layers recompute their window instead of caching it."""
        return not self.bounded_replay

    def token_slot_key(self) -> object:
        # Not of one uniform type with plain sliding-window layers (vLLM
        # registers the MLA variant as its own uniform base).
        return ("mla", self.sliding_window, self.bounded_replay)


@dataclass(frozen=True, slots=True)
class CircularBufferSpec(AttentionSpec):
    """A ring of ``block_size`` rows per request: the keys of the token group a
    compressor has not folded yet. A request claims one block at its first
    allocation and keeps it until it finishes; nothing is prefix cached.

    ``head_size_v`` is the value size per head (``0``: keys only).
    """

    head_size_v: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.head_size_v is not None and (type(self.head_size_v) is not int or self.head_size_v < 0):
            raise InvalidConfigError(
                f"CircularBufferSpec.head_size_v must be a non-negative int or None, "
                f"got {self.head_size_v!r}")
        AttentionSpec.__post_init__(self)

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * num_kv_heads * (head_size + head_size_v) * dtype size``."""
        v = self.head_size if self.head_size_v is None else self.head_size_v
        return self.block_size * self.num_kv_heads * (self.head_size + v) * dtype_size(self.dtype)

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """One page: the ring, whatever the request's length (CFG-9b)."""
        return self.page_size_bytes

    @property
    def prefix_cacheable(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding window: prompt tokens stay visible to every later
    token; of the generated tokens only the last ``rswa_window`` are read.
    It pages as full attention (CFG-9c, CFG-6)."""

    rswa_window: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        FullAttentionSpec.__post_init__(self)
        _positive(self, "rswa_window", self.rswa_window)

    def token_slot_key(self) -> object:
        return ("rswa", self.rswa_window)


@dataclass(frozen=True, slots=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """An encoder-only attention layer: its keys and values live for one
    forward pass, so it needs no KV cache memory and no block table."""

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """Nothing is kept between steps (CFG-9d)."""
        return 0


def prefix_cacheable(spec: KVCacheSpec) -> bool:
    """Whether a group of this spec takes part in prefix caching (vLLM 0.33's
    ``KVCacheSpec.prefix_cacheable``): false for rings, bounded-replay
    sliding-window MLA and uniform-type groups holding either (their own
    ``prefix_cacheable`` asks each layer)."""
    flag = getattr(spec, "prefix_cacheable", True)
    return bool(flag)

