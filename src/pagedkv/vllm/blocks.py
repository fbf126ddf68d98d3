"""vLLM's block objects and block pool, as live views of pagedkv's pool.

pagedkv keeps a block as an id into a few arrays (ref count, hash, group,
free-queue links); vLLM's scheduler and tests hold ``KVCacheBlock`` objects
and read ``block_id``, ``ref_cnt``, ``block_hash``, ``is_null``. A
:class:`BlockView` is one such object whose attributes *read* pagedkv's
arrays, so it is never stale and never needs updating; one view per block id
is made once, as vLLM makes one ``KVCacheBlock`` per block. Views are
read-only: every change goes through pagedkv's operations.

:class:`BlockPoolView` answers the part of vLLM's ``BlockPool`` interface
engines and vLLM's tests use, by translating to ``pagedkv.optimized``'s pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, cast

from pagedkv.optimized.engine import BlockPool, HashViews, key_block, state_key
from pagedkv.spec.hashing import HashedRequest
from pagedkv.spec.types import BlockHashWithGroupId, get_block_hash, get_group_id, make_block_hash_with_group_id

from .requests import VllmRequestView

__all__ = ["BlockView", "BlockPoolView", "FreeQueueView", "CachedBlocksView", "hit_block_ids"]


_block_id = attrgetter("block_id")


def hit_block_ids(group: Sequence[Any]) -> list[int]:
    """The ids of one group of a prefix hit handed back to ``allocate_slots``
    (vLLM's block objects, this layer's views, or ids): ``[b if type(b) is
    int else int(b.block_id) for b in group]``, read in C when every block
    is an object whose id is an int (the hit ``get_computed_blocks`` gave).
    Cost: O(len(group))."""
    try:
        ids = list(map(_block_id, group))
    except AttributeError:  # ids among the blocks
        return [b if type(b) is int else int(b.block_id) for b in group]
    if list(map(type, ids)).count(int) != len(ids):
        return [int(block_id) for block_id in ids]
    return ids


class BlockView:
    """vLLM's ``KVCacheBlock`` for block ``block_id`` of a pagedkv pool."""

    __slots__ = ("block_id", "_pool", "_owner")

    def __init__(self, block_id: int, pool: BlockPool, owner: BlockPoolView) -> None:
        self.block_id = block_id
        self._pool = pool
        self._owner = owner

    @property
    def ref_cnt(self) -> int:
        return self._pool.ref_counts[self.block_id]

    @property
    def block_hash(self) -> Any:
        """The cache key (hash + 4-byte group id), or None when not cached."""
        return self._pool.cache_key(self.block_id)

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Tokens the block's key covers (KEYTOK-1), or None when not cached."""
        return self._pool.key_tokens(self.block_id)

    @property
    def prev_free_block(self) -> Any:
        return self._free_neighbour(self._pool.free_queue.prev, self._owner.free_block_queue.fake_free_list_head)

    @property
    def next_free_block(self) -> Any:
        return self._free_neighbour(self._pool.free_queue.next, self._owner.free_block_queue.fake_free_list_tail)

    def _free_neighbour(self, links: list[int], end: Any) -> Any:
        pool = self._pool
        if self.block_id == 0 or pool.ref_counts[self.block_id] != 0:
            return None
        neighbour = links[self.block_id]
        return end if neighbour == pool.free_queue.sentinel else self._owner.blocks[neighbour]

    def __repr__(self) -> str:
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"block_hash={self.block_hash!r})")


class _FreeListEnd:
    """The head or tail sentinel of vLLM's free list (``fake_free_list_head``/``_tail``)."""

    def __init__(self, pool: BlockPool, owner: BlockPoolView, is_head: bool) -> None:
        self._pool = pool
        self._owner = owner
        self._is_head = is_head
        self.block_id = -1

    def _end_neighbour(self, links: list[int], other_end: Any) -> Any:
        queue = self._pool.free_queue
        neighbour = links[queue.sentinel]
        return other_end if neighbour == queue.sentinel else self._owner.blocks[neighbour]

    @property
    def next_free_block(self) -> Any:
        if not self._is_head:
            return None
        return self._end_neighbour(self._pool.free_queue.next,
                                   self._owner.free_block_queue.fake_free_list_tail)

    @property
    def prev_free_block(self) -> Any:
        if self._is_head:
            return None
        return self._end_neighbour(self._pool.free_queue.prev,
                                   self._owner.free_block_queue.fake_free_list_head)


class FreeQueueView:
    """vLLM's ``FreeKVCacheBlockQueue``, read-only, over pagedkv's free queue."""

    def __init__(self, pool_view: BlockPoolView) -> None:
        self._view = pool_view
        self.fake_free_list_head = _FreeListEnd(pool_view.core, pool_view, True)
        self.fake_free_list_tail = _FreeListEnd(pool_view.core, pool_view, False)

    @property
    def num_free_blocks(self) -> int:
        return self._view.core.get_num_free_blocks()

    def get_all_free_blocks(self) -> list[BlockView]:
        """The free blocks, the next to be allocated first. Cost: O(free blocks)."""
        blocks = self._view.blocks
        return [blocks[i] for i in self._view.core.free_queue_ids()]

    def __len__(self) -> int:
        return self.num_free_blocks


class CachedBlocksView:
    """vLLM's ``cached_block_hash_to_block``: cache key -> cached blocks.

    Read from pagedkv's pool on every call (O(num_blocks)): for tests and
    tools, not for a hot path. ``pop`` evicts the block through pagedkv (its
    hash is dropped, as a cache-map removal in vLLM is followed by a reset);
    ``_cache`` is a snapshot in vLLM's layout (one block, or a dict of them).
    """

    def __init__(self, pool_view: BlockPoolView) -> None:
        self._view = pool_view

    def _entries(self) -> dict[bytes, list[int]]:
        core = self._view.core
        entries: dict[bytes, list[int]] = {}
        for block_id in range(core.num_blocks):
            key = core.cache_key(block_id)
            if key is not None:
                entries.setdefault(key, []).append(block_id)
        return entries

    @property
    def _cache(self) -> _LiveCacheMap:
        blocks = self._view.blocks
        return _LiveCacheMap(self._view, {
            key: blocks[ids[0]] if len(ids) == 1 else {i: blocks[i] for i in ids}
            for key, ids in self._entries().items()})

    def get_one_block(self, key: bytes) -> BlockView | None:
        ids = self._entries().get(bytes(key))
        return None if not ids else self._view.blocks[ids[0]]

    def pop(self, key: bytes, block_id: int) -> BlockView | None:
        core = self._view.core
        if core.cache_key(block_id) != key:
            return None
        core.evict_blocks([block_id])
        return self._view.blocks[block_id]

    def __len__(self) -> int:
        return len(self._entries())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key in self._entries()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries())


class _LiveCacheMap(dict[bytes, Any]):
    """``_cache``: a snapshot in vLLM's layout whose ``pop`` and item
    assignment reach pagedkv's pool, as vLLM's tests edit the map to evict a
    key and put it back. ``pop`` evicts the key's blocks; assigning a block
    (or a dict of them) that lost its key re-keys it, emitting no event (a
    map edit in vLLM emits none). A block given another key since is left
    alone."""

    def __init__(self, pool_view: BlockPoolView, entries: dict[bytes, Any]) -> None:
        super().__init__(entries)
        self._view = pool_view

    def pop(self, key: bytes, *default: Any) -> Any:
        found = super().pop(key, *default)
        core = self._view.core
        ids = [block_id for block_id in range(core.num_blocks) if core.cache_key(block_id) == key]
        if ids:
            core.evict_blocks(ids)
        return found

    def __setitem__(self, key: bytes, value: Any) -> None:
        super().__setitem__(key, value)
        core = self._view.core
        views = list(value.values()) if isinstance(value, dict) else [value]
        block_hash, group_id = get_block_hash(BlockHashWithGroupId(key)), get_group_id(BlockHashWithGroupId(key))
        events, core.enable_kv_cache_events = core.enable_kv_cache_events, False
        try:
            for view in views:
                block_id = view.block_id
                if block_id and core.cache_key(block_id) is None:
                    # Events are off for this call, the only reader of the request.
                    core.cache_full_blocks(cast(HashedRequest, None), [block_id], block_hashes=[block_hash],
                                           num_cached_blocks=0,
                                           num_full_blocks=1, block_size=1, group_id=group_id)
        finally:
            core.enable_kv_cache_events = events


class BlockPoolView:
    """vLLM's ``BlockPool`` interface over a pagedkv pool."""

    def __init__(self, core: BlockPool, enable_caching: bool, hash_block_size: int,
                 translate_events: Any) -> None:
        self.core = core
        self.num_gpu_blocks = core.num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks: list[BlockView] = [BlockView(i, core, self) for i in range(core.num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeQueueView(self)
        self.cached_block_hash_to_block = CachedBlocksView(self)
        self._translate_events = translate_events

    def views(self, ids: Iterable[int]) -> list[BlockView]:
        blocks = self.blocks
        return [blocks[i] for i in ids]

    def get_num_free_blocks(self) -> int:
        return self.core.get_num_free_blocks()

    def get_usage(self) -> float:
        return self.core.get_usage()

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> (
            list[BlockView] | None):
        ids = self.core.get_cached_block(block_hash, kv_cache_group_ids)
        if ids is None:
            ids = self._cached_by_last_hash(bytes(block_hash), kv_cache_group_ids)
        return None if ids is None else self.views(ids)

    def _cached_by_last_hash(self, block_hash: bytes, group_ids: list[int]) -> list[int] | None:
        """vLLM 0.33 keys a block larger than the hash block by the hash of its
        last hash block; pagedkv by the concatenation of its hash blocks
        (D-HASH-5), which ends with that hash. Either names the same prefix,
        so a miss is looked up again by suffix (D-MAMBA-25). Cost: O(cached keys)."""
        found: list[int] = []
        for group_id in group_ids:
            table = self.core.cached_by_group[group_id]
            block = table.get(block_hash)
            if block is None:
                block = next((holder for key, holder in table.items()
                              if len(key) > len(block_hash) and len(key) % len(block_hash) == 0
                              and key.endswith(block_hash)), None)
            if block is None:
                return None
            found.append(block)
        return found

    def get_new_blocks(self, num_blocks: int) -> list[BlockView]:
        return self.views(self.core.get_new_blocks(num_blocks))

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        self.core.free_blocks([block.block_id for block in ordered_blocks])

    def cache_full_blocks(self, request: Any, blocks: Sequence[Any], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: Sequence[bool] | None = None) -> None:
        """vLLM's ``BlockPool.cache_full_blocks`` on pagedkv's pool: the request's
        hashes seen at ``block_size``, the group id carried into the events."""
        view = request if isinstance(request, VllmRequestView) else VllmRequestView(request)
        hashes = HashViews(view.block_hashes, self.hash_block_size).at(block_size)
        self.core.cache_full_blocks(
            view, [block.block_id for block in blocks], block_hashes=hashes,
            num_cached_blocks=num_cached_blocks, num_full_blocks=num_full_blocks,
            block_size=block_size, group_id=kv_cache_group_id,
            mask=None if block_mask is None else list(block_mask))

    def cache_partial_block(self, request: Any, block: Any, num_tokens: int, kv_cache_group_id: int,
                            block_size: int, replace_existing_hashes: bool = False) -> Any:
        """vLLM's ``BlockPool.cache_partial_block``: make ``block`` reachable
        from the prefix boundary ``num_tokens`` (a hash-block multiple) under
        that boundary's state key (spec/mamba.md: the hash of the hash block
        ending there, the group's full key at a block end). pagedkv's pool
        keeps one key per block (CACHE-1): a key covering fewer tokens, or any
        key with ``replace_existing_hashes``, gives way (``BlockRemoved``); a
        block keyed further keeps its key and nothing is registered (vLLM
        would add a second key, D-MAMBA-22). No event for the new key
        (D-MAMBA-18). Returns the key with its group, or ``None``."""
        if block.is_null:
            return None
        view = request if isinstance(request, VllmRequestView) else VllmRequestView(request)
        key = state_key(view.block_hashes, num_tokens, self.hash_block_size, block_size)
        if key is None:
            return None
        core, block_id = self.core, block.block_id
        keyed = core.key_tokens(block_id)
        if keyed is not None:
            if core.block_hashes[block_id] == key and keyed == num_tokens:
                return make_block_hash_with_group_id(key, kv_cache_group_id)
            if not replace_existing_hashes and keyed >= num_tokens:
                return None
            core.evict_blocks([block_id])
        key_block(core, block_id, key, kv_cache_group_id, num_tokens)
        return make_block_hash_with_group_id(key, kv_cache_group_id)

    def touch(self, blocks: Any) -> None:
        # vLLM 0.33 passes a flat list of blocks, 0.32 one list per group; the null block is skipped.
        ids = [b.block_id for item in blocks
               for b in ((item,) if hasattr(item, "block_id") else item)]
        self.core.touch([b for b in ids if b])

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.core.evict_blocks(list(block_ids))

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    @property
    def kv_event_queue(self) -> list[Any]:
        """Events not yet taken (pagedkv's, untranslated; read-only)."""
        return self.core.pending_events

    def take_events(self) -> list[Any]:
        events = self.core.take_events()
        return list(self._translate_events(events)) if events else []
