"""Capacity: does one request fit, how long may requests be, how many fit.

Every function here is a pure function of a ``ModelSetting``, the layers'
specs (or a planned ``KVCacheConfig``) and a memory budget in bytes. The
formulas are stated in spec/config.md (CFG-17..CFG-19, CFG-24); the integer
arithmetic itself lives, with contracts, in ``sizing``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from pagedkv.spec import sizing
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InsufficientMemoryError, InvalidConfigError
from pagedkv.spec.kv_cache_spec import KVCacheSpec
from pagedkv.spec.setting import ModelSetting

__all__ = [
    "GiB",
    "DEFAULT_SEARCH_LIMIT",
    "max_memory_usage_bytes",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "get_max_concurrency_for_kv_cache_config",
    "kv_cache_size_tokens",
    "check_available_memory",
]

GiB: Final = 1 << 30

DEFAULT_SEARCH_LIMIT: Final = 1 << 24
"""The longest ``max_model_len`` ``estimate_max_model_len`` considers
(16,777,216 tokens): models whose memory stops growing with the length
(sliding window only, Mamba only) fit at every length."""


def check_available_memory(available_memory: object) -> int:
    """``available_memory`` as an int of bytes, or ``InvalidConfigError``."""
    if type(available_memory) is not int or available_memory < 0:
        raise InvalidConfigError(
            f"available_memory must be an int >= 0 (bytes), got {available_memory!r}")
    return available_memory


def _check_specs(specs: Mapping[str, KVCacheSpec]) -> None:
    for name, spec in specs.items():
        if not isinstance(name, str) or not name:
            raise InvalidConfigError(f"layer names must be non-empty str, got {name!r}")
        if not isinstance(spec, KVCacheSpec):
            raise InvalidConfigError(
                f"the spec of layer {name!r} must be a KVCacheSpec, got {spec!r}")


def max_memory_usage_bytes(setting: ModelSetting, specs: Iterable[KVCacheSpec]) -> int:
    """Bytes one request of ``setting.max_model_len`` tokens can hold over
    all these layers at once: the sum of each layer's worst case (CFG-17)."""
    return sum(spec.max_memory_usage_bytes(setting) for spec in specs)


def check_enough_kv_cache_memory(setting: ModelSetting, specs: Mapping[str, KVCacheSpec],
                                 available_memory: int) -> None:
    """Raise ``InsufficientMemoryError`` unless ``available_memory`` holds one
    request of ``setting.max_model_len`` tokens in every layer (CFG-17).

    The message states the memory needed and available and the largest
    ``max_model_len`` that would fit. An attention-free model (no layers)
    always passes.
    """
    check_available_memory(available_memory)
    _check_specs(specs)
    if not specs:
        return
    if available_memory == 0:
        raise InsufficientMemoryError(
            "available_memory is 0 bytes: no memory is left for the KV cache blocks; "
            "raise the GPU memory utilization")
    needed = max_memory_usage_bytes(setting, specs.values())
    if needed <= available_memory:
        return
    fitting = estimate_max_model_len(
        setting, specs, available_memory, search_limit=setting.max_model_len)
    hint = (f"the largest max_model_len that fits is {fitting}" if fitting > 0
            else "not even a 1-token request fits")
    raise InsufficientMemoryError(
        f"max_model_len={setting.max_model_len} needs {needed} bytes "
        f"({needed / GiB:.2f} GiB) of KV cache for one request, but available_memory is "
        f"{available_memory} bytes ({available_memory / GiB:.2f} GiB); {hint}. "
        f"Raise the memory or lower max_model_len.")


def estimate_max_model_len(setting: ModelSetting, specs: Mapping[str, KVCacheSpec],
                           available_memory: int, *,
                           search_limit: int = DEFAULT_SEARCH_LIMIT) -> int:
    """The largest ``max_model_len`` in ``[1, search_limit]`` whose one request
    fits in ``available_memory``, or 0 when not even length 1 fits (CFG-18).

    Binary search: memory needed never decreases as the length grows, so the
    lengths that fit form a prefix ``[1, r]``. Contract: ``r == 0`` and length
    1 does not fit, or length ``r`` fits and ``r == search_limit`` or length
    ``r + 1`` does not fit. The other fields of ``setting`` are kept.

    Runtime complexity: O(layers * log(search_limit)).
    """
    check_available_memory(available_memory)
    _check_specs(specs)
    if type(search_limit) is not int or search_limit < 1:
        raise InvalidConfigError(f"search_limit must be an int >= 1, got {search_limit!r}")
    layers = list(specs.values())

    def fits(model_len: int) -> bool:
        return max_memory_usage_bytes(setting.with_max_model_len(model_len), layers) <= available_memory

    if not fits(1):
        return 0
    low, high = 1, search_limit  # invariant: fits(low); every length > high does not fit or is out of range
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def get_max_concurrency_for_kv_cache_config(setting: ModelSetting, config: KVCacheConfig) -> float:
    """How many requests of ``setting.max_model_len`` tokens the pool holds at
    once (CFG-19): ``num_blocks / blocks_per_request``, where a request needs,
    in every group, as many blocks as its worst case fills.

    With ``L`` the most layers in a group:
    ``blocks_per_request = cdiv(L * sum(group max_memory_usage), L * page_size of group 0)``.
    An attention-free configuration (no groups) raises ``InvalidConfigError``:
    there is no KV cache to share.
    """
    groups = config.kv_cache_groups
    if not groups:
        raise InvalidConfigError(
            "KVCacheConfig.kv_cache_groups is empty (attention-free model): "
            "the KV cache does not bound concurrency")
    layers_per_group = max(len(group.layer_names) for group in groups)
    per_request = layers_per_group * max_memory_usage_bytes(
        setting, (group.kv_cache_spec for group in groups))
    per_block = groups[0].kv_cache_spec.page_size_bytes * layers_per_group
    return config.num_blocks / sizing.blocks_per_request(per_request, per_block)


def kv_cache_size_tokens(setting: ModelSetting, config: KVCacheConfig) -> int:
    """Tokens the KV cache holds (CFG-18): the blocks split evenly over the
    groups, times the smallest group block size, times ``dcp * pcp`` (CFG-24); 0 for
    an attention-free configuration."""
    groups = config.kv_cache_groups
    if not groups:
        return 0
    min_block_size = min(group.kv_cache_spec.block_size for group in groups)
    return sizing.kv_cache_size_tokens(
        config.num_blocks, len(groups), min_block_size,
        setting.dcp_world_size, setting.pcp_world_size)
