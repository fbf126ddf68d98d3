"""vLLM 0.33's HiSparse configuration, read as pagedkv's host tier.

vLLM marks the group whose KV lives in host memory with
``KVCacheGroupSpec.host_resident`` and role ``hisparse_source``, derives
``HiSparseResidentSpec`` and ``HiSparseHotSpec`` groups for the device side,
and sizes the host pool with ``KVCacheConfig.hisparse_host_num_blocks``.
This module translates such a configuration (read by attribute and class
name, so no vLLM import) into pagedkv's ``KVCacheConfig`` with the same
roles and a :class:`~pagedkv.spec.hisparse.HostTierConfig`
(spec/host_tier.md).

:mod:`pagedkv.vllm.hisparse_manager` serves such a config (D-HOST-21).
"""

from __future__ import annotations

from typing import Any

from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hisparse import (
    HiSparseHotSpec,
    HiSparseResidentSpec,
    HostTierConfig,
    host_tier_config,
)
from pagedkv.spec.kv_cache_spec import KVCacheSpec

from .config import translate_spec

__all__ = ["is_hisparse_config", "translate_hisparse_config", "translate_hisparse_spec"]


def is_hisparse_config(config: Any) -> bool:
    """Whether a vLLM ``KVCacheConfig`` has a HiSparse host pool."""
    return getattr(config, "hisparse_host_num_blocks", None) is not None


def translate_hisparse_spec(spec: Any) -> KVCacheSpec:
    """pagedkv's spec for a vLLM spec object, HiSparse's derived specs included."""
    kind = type(spec).__name__
    if kind == "HiSparseHotSpec":
        return HiSparseHotSpec(int(spec.block_size), page_size=int(spec.page_size),
                               blocks_per_request=int(spec.blocks_per_request))
    if kind == "HiSparseResidentSpec":
        return HiSparseResidentSpec(int(spec.block_size), page_size=int(spec.page_size))
    return translate_spec(spec)


def _role(group: Any) -> str:
    role = getattr(group, "role", "default")
    return str(getattr(role, "value", role))


def translate_hisparse_config(config: Any, max_model_len: int, enable_caching: bool = True,
                              max_num_batched_tokens: int | None = None,
                              num_prefill_lookahead: int = 0,
                              ) -> tuple[KVCacheConfig, HostTierConfig]:
    """pagedkv's ``KVCacheConfig`` (roles and ``host_resident`` kept) and the
    host tier of a vLLM HiSparse ``KVCacheConfig``. A multi-module drafter
    prefills the last ``num_prefill_lookahead - 1`` tokens again, so the
    tier never writes them back (vLLM 0.33's reprefillable tokens, D-HOST-13).

    Raises:
        InvalidConfigError: the config has no ``hisparse_host_num_blocks``, or
            its groups do not make a host tier (see ``host_tier_config``).
        UnsupportedVllmSpecError: a group's spec kind pagedkv does not know.
    """
    if not is_hisparse_config(config):
        raise InvalidConfigError("the vLLM KVCacheConfig has no hisparse_host_num_blocks")
    groups = tuple(
        KVCacheGroupSpec(tuple(group.layer_names), translate_hisparse_spec(group.kv_cache_spec),
                         host_resident=bool(getattr(group, "host_resident", False)),
                         role=_role(group))
        for group in config.kv_cache_groups)
    ours = KVCacheConfig(num_blocks=int(config.num_blocks), kv_cache_tensors=(),
                         kv_cache_groups=groups)
    tier = host_tier_config(ours, int(config.hisparse_host_num_blocks), max_model_len,
                            enable_caching, max_num_batched_tokens,
                            num_reprefillable_tokens=max(0, num_prefill_lookahead - 1))
    return ours, tier
