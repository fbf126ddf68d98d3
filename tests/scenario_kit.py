"""Small builders the scenario suites share: layer specs with the sizes the
scenarios use, and a manager over a tuple of group specs. Scenario files
keep only what is particular to them (their pool size, their model length)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from pagedkv.spec.kv_cache_spec import SlidingWindowSpec


def full(block_size: int = 4) -> FullAttentionSpec:
    """A full-attention layer: one KV head of size 8, float16."""
    return FullAttentionSpec(block_size, 1, 8, "float16")


def window(block_size: int = 4, size: int = 4) -> SlidingWindowSpec:
    """A sliding-window layer of ``size`` tokens, otherwise as :func:`full`."""
    return SlidingWindowSpec(block_size, 1, 8, "float16", sliding_window=size)


def build_manager(
    impl: ModuleType, specs: tuple[KVCacheSpec, ...], *, num_blocks: int, max_model_len: int, **kwargs: Any
) -> Any:
    """``impl.KVCacheManager`` with one group per spec (layer ``l<i>`` in group i)."""
    groups = tuple(KVCacheGroupSpec((f"l{i}",), spec) for i, spec in enumerate(specs))
    return impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), max_model_len=max_model_len, **kwargs)
