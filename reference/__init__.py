"""pagedkv.reference: the simplest code that is obviously right.

Mirrors spec/ section by section: :mod:`.block_pool` (spec/operations.md,
block pool), :mod:`.single_type` (spec/managers.md), :mod:`.coordinator`
(spec/coordinators.md), :mod:`.manager` (the facade), :mod:`.validation` (every argument check),
:mod:`.hasher`
(spec/hashing.md), :mod:`.rules` (the arithmetic, with CrossHair contracts)
and :mod:`.invariants` (``check_invariants``, spec/state.md). Speed is not
its job; the differential tests hold ``pagedkv.optimized`` to it.
"""

from pagedkv.reference.block_pool import BlockPool, KVCacheBlock
from pagedkv.reference.blocks import KVCacheBlocks
from pagedkv.reference.manager import KVCacheManager
from pagedkv.spec.metrics import PrefixCachingMetrics

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheBlocks", "KVCacheManager", "PrefixCachingMetrics"]
