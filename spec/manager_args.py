"""The constructor arguments of ``KVCacheManager``, checked once for both
implementations (spec/operations.md, "KVCacheManager", construction).

The rules are the same whatever the representation, so they live here, in
the shared vocabulary, rather than in each implementation. The checks run
in the order below; the first that fails raises.
"""

from __future__ import annotations

from math import gcd, lcm

from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.errors import InvalidConfigError
from pagedkv.spec.hashing import check_lookahead, normalize_hash_fn
from pagedkv.spec.registry import manager_kind_for

__all__ = ["check_manager_args"]


def _positive_int(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def check_manager_args(
    *, kv_cache_config: KVCacheConfig, max_model_len: object, hash_fn: str,
    hash_block_size: object, dcp_world_size: object, pcp_world_size: object,
    retention_interval: object, max_num_batched_tokens: object, hash_seed: object = None,
    num_hash_lookahead_tokens: object = 0, num_prefill_lookahead: object = 0,
) -> tuple[tuple[int, ...], int | None]:
    """Check the manager's arguments; return each group's block size (its
    spec's block size times ``dcp_world_size * pcp_world_size``) and the hash
    block size (by default the GCD of the block sizes, D-HASH-5; ``None``
    with zero groups: nothing is hashed).

    Raises:
        InvalidConfigError: ``max_model_len``, a world size,
            ``kv_cache_config``, ``hash_block_size`` (must divide every
            block size), ``retention_interval`` (``None``, 0 or a multiple
            of the hit alignment, the LCM of the block sizes) or
            ``max_num_batched_tokens`` malformed, ``hash_seed`` neither a
            str nor ``None``, ``num_hash_lookahead_tokens`` or
            ``num_prefill_lookahead`` not an int ``>= 0``; context parallelism with a
            group other than full attention; a ``host_resident`` group.
        InvalidArgumentError: unknown ``hash_fn``.
    """
    _positive_int("max_model_len", max_model_len)
    scale = (_positive_int("dcp_world_size", dcp_world_size)
             * _positive_int("pcp_world_size", pcp_world_size))
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise InvalidConfigError(
            f"kv_cache_config must be a KVCacheConfig, got {type(kv_cache_config).__name__}")
    groups = kv_cache_config.kv_cache_groups
    for group_id, group in enumerate(groups):
        if group.host_resident:  # D-HOST-1: host pools are the host tier's
            raise InvalidConfigError(
                f"kv_cache_groups[{group_id}] is host_resident; the KV cache manager manages "
                "device pools only: give HiSparse groups to HostTierManager (spec/host_tier.md)")
    if scale > 1:
        for group_id, group in enumerate(groups):
            if manager_kind_for(group.kv_cache_spec) not in ("full_attention", "sink_full_attention", "rswa"):
                raise InvalidConfigError(
                    f"kv_cache_groups[{group_id}]: context parallelism supports full attention "
                    f"only, got {type(group.kv_cache_spec).__name__}")
    normalize_hash_fn(hash_fn)
    # Groups outside prefix caching are never hashed nor hit (PFX-1): only the
    # others constrain the hash block size and the hit alignment.
    block_sizes = tuple(group.kv_cache_spec.block_size * scale for group in groups)
    cacheable_sizes = tuple(size for size, group in zip(block_sizes, groups)
                            if prefix_cacheable(group.kv_cache_spec)) or block_sizes
    if hash_block_size is None and cacheable_sizes:
        hash_block_size = gcd(*cacheable_sizes)
    if hash_block_size is not None and (type(hash_block_size) is not int or hash_block_size < 1 or any(
            size % hash_block_size for size in cacheable_sizes)):
        raise InvalidConfigError(
            f"hash_block_size must be a positive int dividing every prefix-cacheable group's block "
            f"size {list(cacheable_sizes)}, got {hash_block_size!r}")
    alignment = lcm(*cacheable_sizes) if cacheable_sizes else 1
    if type(retention_interval) is int and retention_interval > 0 and not any(
            manager_kind_for(group.kv_cache_spec) in ("sliding_window", "mamba") for group in groups):
        raise InvalidConfigError(
            f"retention_interval={retention_interval} but the model has no sliding-window or Mamba "
            f"group, so retention would have no effect: pass 0 or None (D-CFG-12)")
    if retention_interval is not None and (type(retention_interval) is not int
                                           or retention_interval < 0
                                           or retention_interval % alignment):
        raise InvalidConfigError(
            f"retention_interval must be None, 0 or a positive multiple of the hit alignment "
            f"{alignment}, got {retention_interval!r}")
    if max_num_batched_tokens is not None and (type(max_num_batched_tokens) is not int
                                               or max_num_batched_tokens < 1):
        raise InvalidConfigError(
            f"max_num_batched_tokens must be a positive int or None, got {max_num_batched_tokens!r}")
    if hash_seed is not None and not isinstance(hash_seed, str):
        raise InvalidConfigError(f"hash_seed must be a str or None, got {hash_seed!r}")
    check_lookahead("num_hash_lookahead_tokens", num_hash_lookahead_tokens)
    check_lookahead("num_prefill_lookahead", num_prefill_lookahead)
    assert hash_block_size is None or type(hash_block_size) is int
    return block_sizes, hash_block_size
