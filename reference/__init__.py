"""pagedkv.reference: the simplest code that is obviously right. The kernel
(this folder) reads top to bottom: :mod:`.block_pool`, :mod:`.hasher`,
:mod:`.rules`, :mod:`.single_type` and the seed types, :mod:`.coordinator`,
:mod:`.manager` (the facade), :mod:`.validation`, :mod:`.invariants`; the
features (``features/``) plug in through :mod:`.hooks` (spec/managers.md §9).
"""

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock, KVCacheBlocks
from pagedkv.reference.manager import KVCacheManager
from pagedkv.spec.metrics import PrefixCachingMetrics

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheBlocks", "KVCacheManager", "PrefixCachingMetrics"]
