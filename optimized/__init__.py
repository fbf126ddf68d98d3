"""pagedkv.optimized: the fast implementation of the block manager.

Same observable behaviour as ``pagedkv.reference`` (spec/operations.md; the
differential tests compare return values and ``snapshot()`` after every
call), different insides: blocks are plain integer ids, per-block state
lives in lists indexed by id, the free queue is an intrusive doubly linked
list with O(1) removal from the middle, and the decode step of
``allocate_slots`` has an O(1) fast path (O(groups) with several
groups). Modules, one concept each:

The package is layered (docs/architecture.md; ``make lint`` enforces the order
with import-linter, each layer importing only those below it):

- ``engine``: the surface an engine adapter uses (``pagedkv.vllm`` imports only it).
- ``manager`` (the :class:`KVCacheManager` facade), ``manager_reads``,
  ``sub_block_ops``, ``validation`` (argument checks of every public operation).
- ``coordination``: the coordinator, its kinds, admission demand, sub-block
  hits, and the request table's ``check_request_invariants``.
- ``paths``: the fast paths of ``allocate_slots`` and recovery.
- ``groups``: the per-group managers and the hit search over groups.
- ``rules``: pure decisions of the optional features.
- ``pool``: the block pool (its ``check_invariants`` beside its tables), free
  queue, cache map, events, :class:`KVCacheBlocks`, the request block hasher.
- ``host_tier``: HiSparse's host tier (independent of the pool).
- ``native``: the optional C modules and their pure-Python fall-backs.

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
