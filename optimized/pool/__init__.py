"""The block pool layer: the one pool of KV-cache blocks every group draws from.

Its free queue, its cache map and events, the block lists it hands out
(:class:`~pagedkv.optimized.pool.blocks.KVCacheBlocks`) and the request block hasher.
It imports only ``pagedkv.spec`` and ``pagedkv.optimized.native`` (docs/architecture.md).
"""
