"""The lockstep machine's connector admission (D-API-46): vLLM 0.33's
``get_computed_blocks_for_connector`` adopts the full-attention group's own
hit when a Mamba group lags it, and the connector loads the tokens after it
(Mamba state included)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.spec import FullAttentionSpec, KVCacheConfig
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["deeper_full_attention_hit"]


def deeper_full_attention_hit(config: KVCacheConfig, each: Callable[[Callable[[int, Any], Any]], list[Any]],
                              requests: Sequence[Any]) -> tuple[list[Any], int] | None:
    """Every implementation's per-group hit and the full-attention group's
    hit length, when that hit is deeper than some Mamba group's and every
    other group matches it (the only shape the connector path adopts);
    otherwise ``None``."""
    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    full = next((g for g, spec in enumerate(specs) if type(spec) is FullAttentionSpec), None)
    if full is None:
        return None
    per_group = each(lambda i, m: m.get_computed_blocks_per_group(requests[i]))
    lengths = per_group[0][1]
    depth = lengths[full]
    mamba = [isinstance(spec, MambaSpec) for spec in specs]
    lagging = any(is_mamba and length < depth for is_mamba, length in zip(mamba, lengths))
    matching = all(length == depth or (is_mamba and length < depth) for is_mamba, length in zip(mamba, lengths))
    if not (lagging and matching):
        return None
    return [blocks for blocks, _ in per_group], depth
