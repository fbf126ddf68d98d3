"""pagedkv.spec: the shared typed vocabulary of every pagedkv implementation.

Value types, KV cache specs and configuration, the request view, results,
events, typed errors, the normative hash functions and the Protocols both
``pagedkv.reference`` and ``pagedkv.optimized`` satisfy. The written
specification lives beside this package in ``spec/*.md``.
"""

from pagedkv.spec.attention_variants import (
    CircularBufferSpec,
    EncoderOnlyAttentionSpec,
    RSWASpec,
    SlidingWindowMLASpec,
)
from pagedkv.spec.capacity import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_max_concurrency_for_kv_cache_config,
    kv_cache_size_tokens,
    max_memory_usage_bytes,
)
from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, check_kv_cache_config
from pagedkv.spec.errors import (
    ExceedsMaxModelLenError,
    IncompatibleSpecError,
    InsufficientMemoryError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTokenCountError,
    InvariantViolation,
    PagedKVError,
    PoolExhaustedError,
    UnknownBlockError,
    UnknownRequestError,
)
from pagedkv.spec.hashing import HASH_FUNCTIONS, hash_block_tokens, seed_hash
from pagedkv.spec.kv_cache_spec import (
    DTYPE_SIZES,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    dtype_size,
)
from pagedkv.spec.mamba_spec import MAMBA_CACHE_MODES, MambaSpec
from pagedkv.spec.metrics import PrefixCachingMetrics
from pagedkv.spec.planner import (
    get_kv_cache_config,
    get_kv_cache_groups,
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_configs,
    unify_kv_cache_spec_page_size,
)
from pagedkv.spec.protocols import BlockPoolLike, KVCacheBlocksLike, KVCacheManagerLike
from pagedkv.spec.registry import BUILTIN_MANAGER_KINDS, manager_kind_for, register_kv_cache_spec
from pagedkv.spec.request import MMFeature, Request, RequestView
from pagedkv.spec.setting import ModelSetting
from pagedkv.spec.snapshot import ManagerSnapshot, PoolSnapshot, RequestSnapshot
from pagedkv.spec.types import (
    AllBlocksCleared,
    BlockHash,
    BlockHashWithGroupId,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    PrefixCacheStats,
)
from pagedkv.spec.uniform_spec import UniformTypeKVCacheSpecs

__all__ = [
    "CircularBufferSpec", "EncoderOnlyAttentionSpec", "RSWASpec", "SlidingWindowMLASpec",
    "BUILTIN_MANAGER_KINDS", "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "DTYPE_SIZES",
    "MAMBA_CACHE_MODES", "MLAAttentionSpec", "MambaSpec", "ModelSetting", "SinkFullAttentionSpec",
    "SlidingWindowSpec", "UniformTypeKVCacheSpecs", "check_enough_kv_cache_memory",
    "check_kv_cache_config", "dtype_size", "estimate_max_model_len", "get_kv_cache_config",
    "get_kv_cache_groups", "get_max_concurrency_for_kv_cache_config", "kv_cache_size_tokens",
    "manager_kind_for", "max_memory_usage_bytes", "register_kv_cache_spec",
    "unify_hybrid_kv_cache_specs", "unify_kv_cache_configs", "unify_kv_cache_spec_page_size",
    "AllBlocksCleared", "AttentionSpec", "BlockHash", "BlockHashWithGroupId",
    "BlockPoolLike", "BlockRemoved", "BlockStored", "ExceedsMaxModelLenError",
    "FullAttentionSpec", "HASH_FUNCTIONS", "IncompatibleSpecError",
    "InsufficientMemoryError", "InvalidArgumentError", "InvalidConfigError",
    "InvalidTokenCountError", "InvariantViolation", "KVCacheBlocksLike",
    "KVCacheConfig", "KVCacheEvent", "KVCacheGroupSpec", "KVCacheManagerLike",
    "KVCacheSpec", "KVCacheTensor", "MMFeature", "ManagerSnapshot", "PagedKVError",
    "PoolExhaustedError", "PoolSnapshot", "PrefixCacheStats", "PrefixCachingMetrics",
    "Request", "RequestSnapshot", "RequestView", "UnknownBlockError",
    "UnknownRequestError", "hash_block_tokens", "seed_hash",
]
