"""pagedkv: a formally specified, verified KV-cache block manager.

``import pagedkv`` gives the optimized implementation's public API
(``pagedkv.KVCacheManager``) and the shared vocabulary types. The simple
reference model is ``pagedkv.reference``; the vocabulary is ``pagedkv.spec``;
the GPU tensor path is ``pagedkv.optimized.tensor`` (needs torch).
"""

from pagedkv.optimized import BlockPool, KVCacheBlocks, KVCacheManager
from pagedkv.spec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MMFeature,
    PagedKVError,
    PrefixCacheStats,
    PrefixCachingMetrics,
    Request,
    RequestView,
)

__all__ = [
    "AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "FullAttentionSpec",
    "KVCacheBlocks", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheManager", "KVCacheTensor",
    "MMFeature", "PagedKVError", "PrefixCacheStats", "PrefixCachingMetrics", "Request", "RequestView",
]
