"""``UniformTypeKVCacheSpecs``: one group for layers of one type but
different sizes.

Layers are of a *uniform type* when they are served by the same manager kind
and need the same number of token slots per request (same window, same chunk
size, same Mamba mode): e.g. full-attention layers with different head
counts. They can share one block table, hence one group, even though their
pages differ; each layer then gets its own tensor sized by its own page
(CFG-13, CFG-16).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Self

from pagedkv.spec import sizing
from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.errors import IncompatibleSpecError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.registry import manager_kind_for
from pagedkv.spec.setting import ModelSetting

__all__ = ["UniformTypeKVCacheSpecs"]


@dataclass(frozen=True, slots=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """The specs of several layers of one uniform type, as one spec.

    ``kv_cache_specs`` is a tuple of ``(layer name, spec)`` pairs (a tuple,
    not a dict, so the value stays hashable); every spec has ``block_size``.
    A block of this spec is one block of each layer, so its page is the sum
    of theirs.
    """

    kv_cache_specs: tuple[tuple[str, KVCacheSpec], ...]

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        pairs = tuple((name, spec) for name, spec in self.kv_cache_specs)
        object.__setattr__(self, "kv_cache_specs", pairs)
        if not pairs:
            raise InvalidConfigError(
                "UniformTypeKVCacheSpecs.kv_cache_specs must hold at least one layer, got none")
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise InvalidConfigError(
                f"UniformTypeKVCacheSpecs.kv_cache_specs names a layer twice: {names}")
        for name, spec in pairs:
            if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
                raise InvalidConfigError(
                    f"UniformTypeKVCacheSpecs.kv_cache_specs[{name!r}] must be a single-layer "
                    f"KVCacheSpec, got {spec!r}")
            if spec.block_size != self.block_size:
                raise IncompatibleSpecError(
                    f"UniformTypeKVCacheSpecs: field 'block_size' differs: layer {name!r} has "
                    f"{spec.block_size}, expected {self.block_size}")
        if not _uniform(dict(pairs)):
            raise IncompatibleSpecError(
                "UniformTypeKVCacheSpecs: field 'type' differs: the layers are not of one "
                "uniform type (same manager kind and token slots)")

    @classmethod
    def is_uniform_type(cls, specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether all layers are served by one manager kind with equal token
        slot keys (window, chunk size, Mamba mode...); false when empty."""
        return bool(specs) and _uniform(specs)

    @classmethod
    def from_specs(cls, specs: Mapping[str, KVCacheSpec]) -> Self | None:
        """The uniform-type spec of these layers, or ``None`` when they are
        not of a uniform type or their block sizes differ."""
        if not cls.is_uniform_type(specs):
            return None
        block_sizes = {spec.block_size for spec in specs.values()}
        if len(block_sizes) != 1:
            return None
        return cls(block_sizes.pop(), tuple(specs.items()))

    def specs_by_layer(self) -> dict[str, KVCacheSpec]:
        """The layers' specs as a dict, in order."""
        return dict(self.kv_cache_specs)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the group takes part in prefix caching: only when every layer does."""
        return all(prefix_cacheable(spec) for _, spec in self.kv_cache_specs)

    @property
    def real_page_size_bytes(self) -> int:
        """The sum of the layers' pages (CFG-3)."""
        return sum(spec.page_size_bytes for _, spec in self.kv_cache_specs)

    def max_memory_usage_bytes(self, setting: ModelSetting) -> int:
        """The most pages any layer needs, times the summed page."""
        max_pages = max(
            sizing.cdiv(spec.max_memory_usage_bytes(setting), spec.page_size_bytes)
            for _, spec in self.kv_cache_specs)
        return max_pages * self.page_size_bytes

    def copy_with_new_block_size(self, block_size: int) -> Self:
        """Every layer's spec with the new block size."""
        return type(self)(block_size, tuple(
            (name, spec.copy_with_new_block_size(block_size)) for name, spec in self.kv_cache_specs))


def _uniform(specs: Mapping[str, KVCacheSpec]) -> bool:
    keys = {(manager_kind_for(spec), spec.token_slot_key()) for spec in specs.values()}
    return len(keys) <= 1
