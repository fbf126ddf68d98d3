"""pagedkv.optimized: the fast implementation of the block manager.

Same observable behaviour as ``pagedkv.reference`` (spec/operations.md; the
differential tests compare return values and ``snapshot()`` after every
call), different insides: blocks are plain integer ids, per-block state
lives in lists indexed by id, the free queue is an intrusive doubly linked
list with O(1) removal from the middle, and the decode step of
``allocate_slots`` has an O(1) fast path (O(groups) with several
groups). Modules, one concept each:

- ``free_queue``: :class:`FreeBlockQueue`.
- ``block_pool``: :class:`BlockPool` (ref counts, hashes, prefix-cache map,
  events).
- ``hasher``: fast request block hashers, byte-identical to the spec's.
- ``blocks``: :class:`KVCacheBlocks`.
- ``single_type``: the per-group manager base, full attention (MLA) and
  sink full attention; ``windowed`` (sliding window, chunked local),
  ``mamba``, ``cross_attention``: the other attention types.
- ``hybrid_search``: the longest common hit of several groups (a
  fixed-point iteration) and per-group hash views.
- ``admission``: full-sequence admission (``full_sequence_must_fit``).
- ``decode``: the per-group test of the decode fast path.
- ``coordinator``: what every coordinator does; each builds the per-group
  managers over the pool the facade built, and holds the decode fast path.
  ``coordinator_kinds``: the no-prefix-cache, unitary and hybrid kinds.
- ``validation``: argument checks of every public operation but the
  constructor's (``pagedkv.spec.manager_args``, shared).
- ``manager``: the :class:`KVCacheManager` facade.
- ``pool_view``, ``pool_invariants``: the pool's read-only side and the
  invariant checks of ``check_invariants()``.

The GPU tensor path lives in ``pagedkv.optimized.tensor`` and is not
imported here (it needs torch).
"""

from pagedkv.optimized.coordination.coordinator import MANAGER_FOR_KIND, KVCacheCoordinator
from pagedkv.optimized.coordination.coordinator_kinds import (
    HybridCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
    make_coordinator,
)
from pagedkv.optimized.groups.cross_attention import CrossAttentionManager
from pagedkv.optimized.groups.mamba import MambaManager
from pagedkv.optimized.groups.single_type import FullAttentionManager, SingleTypeManager, SinkFullAttentionManager
from pagedkv.optimized.groups.windowed import ChunkedLocalAttentionManager, SlidingWindowManager
from pagedkv.optimized.pool.block_pool import NULL_BLOCK, BlockPool
from pagedkv.optimized.pool.blocks import KVCacheBlocks
from pagedkv.optimized.pool.free_queue import FreeBlockQueue
from pagedkv.optimized.pool.hasher import make_block_hasher
from pagedkv.spec.metrics import PrefixCachingMetrics

from .manager import KVCacheManager

__all__ = [
    "BlockPool", "ChunkedLocalAttentionManager", "CrossAttentionManager", "FreeBlockQueue",
    "FullAttentionManager", "HybridCoordinator", "KVCacheBlocks", "KVCacheCoordinator",
    "KVCacheManager", "MANAGER_FOR_KIND", "MambaManager", "NULL_BLOCK",
    "NoPrefixCacheCoordinator", "PrefixCachingMetrics", "SingleTypeManager",
    "SinkFullAttentionManager", "SlidingWindowManager", "UnitaryCoordinator",
    "make_block_hasher", "make_coordinator",
]
