"""pagedkv.optimized: the fast implementation of the full-attention slice.

Same observable behaviour as ``pagedkv.reference`` (notes/semantics.md; the
differential tests compare return values and ``snapshot()`` after every
call), different insides: blocks are plain integer ids, per-block state
lives in lists indexed by id, the free queue is an intrusive doubly linked
list with O(1) removal from the middle, and the decode step of
``allocate_slots`` has an O(1) fast path. Modules, one concept each:

- ``free_queue``: :class:`FreeBlockQueue`.
- ``block_pool``: :class:`BlockPool` (ref counts, hashes, prefix-cache map,
  events).
- ``hasher``: fast request block hashers, byte-identical to the spec's.
- ``blocks``: :class:`KVCacheBlocks`.
- ``single_type``: per-group managers by attention type (full attention
  now) and their registry.
- ``coordinator``: no-prefix-cache and unitary coordinators.
- ``manager``: the :class:`KVCacheManager` facade.

The GPU tensor path lives in ``pagedkv.optimized.tensor`` and is not
imported here (it needs torch).
"""

from pagedkv.spec.metrics import PrefixCachingMetrics

from .block_pool import NULL_BLOCK, BlockPool
from .blocks import KVCacheBlocks
from .coordinator import (
    KVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
    make_coordinator,
)
from .free_queue import FreeBlockQueue
from .hasher import make_block_hasher
from .manager import KVCacheManager
from .single_type import (
    MANAGER_REGISTRY,
    FullAttentionManager,
    SingleTypeKVCacheManager,
)

__all__ = [
    "BlockPool", "FreeBlockQueue", "FullAttentionManager", "KVCacheBlocks",
    "KVCacheCoordinator", "KVCacheManager", "MANAGER_REGISTRY", "NULL_BLOCK",
    "NoPrefixCacheCoordinator", "PrefixCachingMetrics", "SingleTypeKVCacheManager",
    "UnitaryCoordinator", "make_block_hasher", "make_coordinator",
]
