"""pagedkv.spec: the shared typed vocabulary of every pagedkv implementation.

Value types, KV cache specs and configuration, the request view, results,
events, typed errors, the normative hash functions and the Protocols both
``pagedkv.reference`` and ``pagedkv.optimized`` satisfy. The written
specification lives beside this package in ``spec/*.md``.
"""

from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
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
from pagedkv.spec.kv_cache_spec import AttentionSpec, FullAttentionSpec, KVCacheSpec
from pagedkv.spec.metrics import PrefixCachingMetrics
from pagedkv.spec.protocols import BlockPoolLike, KVCacheBlocksLike, KVCacheManagerLike
from pagedkv.spec.request import MMFeature, Request, RequestView
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

__all__ = [
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
