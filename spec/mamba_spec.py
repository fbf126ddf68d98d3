"""The Mamba (state-space) layer spec.

A Mamba layer keeps a fixed-size recurrent state per request instead of one
entry per token: its "page" is the state (a few arrays of given shapes and
dtypes), and a request holds a handful of pages whatever its length. See
spec/config.md, CFG-5 and CFG-9.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Final

from pagedkv.spec import sizing
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.kv_cache_spec import (
    DTYPE_SIZES,
    KVCacheSpec,
    _no_context_parallelism,
    _positive,
    dtype_size,
)
from pagedkv.spec.setting import ModelSetting

__all__ = ["MambaSpec", "MAMBA_CACHE_MODES"]

MAMBA_CACHE_MODES: Final = ("none", "align", "all")
"""How much of a request's state history is kept for prefix caching:
``none`` only the running state, ``align`` also the state at the last block
boundary, ``all`` the state at every block boundary."""


@dataclass(frozen=True, slots=True)
class MambaSpec(KVCacheSpec):
    """A Mamba layer: the state arrays ``shapes[i]`` of ``dtypes[i]``.

    - ``mamba_type``: the state-space variant (``"mamba1"``, ``"mamba2"``...),
      recorded, not interpreted.
    - ``mamba_cache_mode``: one of ``MAMBA_CACHE_MODES``.
    - ``num_speculative_blocks``: extra state blocks kept for speculative
      decoding steps.
    - ``num_prefill_checkpoint_blocks``: ``> 0`` (mode ``align`` only) lets a
      prefill chunk reserve one extra state block so the worker can export
      the state at a hash boundary inside the chunk (spec/mamba.md, MCKPT-1).
    - ``prefill_checkpoint_alignment``: the token step, counted from the
      chunk start, at which the backend can export such a state; ``None``
      means it cannot, and no checkpoint is reserved.
    - ``page_size_padded`` (keyword only): pad the page to this many bytes so
      that it matches the attention layers' pages (CFG-15).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    page_size_padded: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        try:
            shapes = tuple(tuple(shape) for shape in self.shapes)
            dtypes = tuple(self.dtypes)
        except TypeError:
            raise InvalidConfigError(
                f"MambaSpec.shapes must be a sequence of shapes and MambaSpec.dtypes a sequence "
                f"of dtype names, got {self.shapes!r} and {self.dtypes!r}") from None
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if not shapes:
            raise InvalidConfigError("MambaSpec.shapes must hold at least one state shape, got ()")
        if len(shapes) != len(dtypes):
            raise InvalidConfigError(
                f"MambaSpec.dtypes must give one dtype per shape ({len(shapes)}), got {len(dtypes)}")
        for i, shape in enumerate(shapes):
            if not shape or any(type(d) is not int or d <= 0 for d in shape):
                raise InvalidConfigError(
                    f"MambaSpec.shapes[{i}] must be a non-empty tuple of positive ints, got {shape!r}")
        for i, dtype in enumerate(dtypes):
            if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
                raise InvalidConfigError(
                    f"MambaSpec.dtypes[{i}] must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
        if not isinstance(self.mamba_type, str) or not self.mamba_type:
            raise InvalidConfigError(
                f"MambaSpec.mamba_type must be a non-empty str, got {self.mamba_type!r}")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise InvalidConfigError(
                f"MambaSpec.mamba_cache_mode must be one of {list(MAMBA_CACHE_MODES)}, "
                f"got {self.mamba_cache_mode!r}")
        if type(self.num_speculative_blocks) is not int or self.num_speculative_blocks < 0:
            raise InvalidConfigError(
                "MambaSpec.num_speculative_blocks must be an int >= 0, "
                f"got {self.num_speculative_blocks!r}")
        if type(self.num_prefill_checkpoint_blocks) is not int or self.num_prefill_checkpoint_blocks < 0:
            raise InvalidConfigError(
                "MambaSpec.num_prefill_checkpoint_blocks must be an int >= 0, "
                f"got {self.num_prefill_checkpoint_blocks!r}")
        if self.prefill_checkpoint_alignment is not None:
            _positive(self, "prefill_checkpoint_alignment", self.prefill_checkpoint_alignment)
        if self.page_size_padded is not None:
            _positive(self, "page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise InvalidConfigError(
                    f"MambaSpec.page_size_padded must be >= the real page size "
                    f"{self.real_page_size_bytes}, got {self.page_size_padded}")

    @property
    def real_page_size_bytes(self) -> int:
        """``sum(prod(shape) * dtype size)`` over the state arrays (CFG-5)."""
        return sum(prod(shape) * dtype_size(dtype) for shape, dtype in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        """The padded page when ``page_size_padded`` is set, else the real one."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """Pages by cache mode (CFG-9): ``none`` 1 + speculative, ``align``
        2 + speculative, ``all`` ``cdiv(max_model_len, block_size)``."""
        _no_context_parallelism(self, setting)
        blocks = sizing.mamba_blocks(
            self.mamba_cache_mode, setting.max_model_len, self.block_size, self.num_speculative_blocks)
        return blocks * self.page_size_bytes

    def token_slot_key(self) -> object:
        return (self.mamba_cache_mode, self.num_speculative_blocks,
                self.num_prefill_checkpoint_blocks, self.prefill_checkpoint_alignment)

    @property
    def has_prefill_checkpoints(self) -> bool:
        """Whether a prefill chunk may reserve a checkpoint block (MCKPT-1)."""
        return (self.mamba_cache_mode == "align" and self.num_prefill_checkpoint_blocks > 0
                and self.prefill_checkpoint_alignment is not None)
