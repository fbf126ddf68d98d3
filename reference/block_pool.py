"""The block pool (spec/operations.md, "Block pool"): ``num_blocks``
numbered blocks, block 0 the null block; each other block is free (in the
free queue, a plain list, front first) or in use (ref count > 0), and may
carry a cache key (the prefix cache: key -> the blocks carrying it, in
insertion order). Slow on purpose: each operation transcribes the spec.
``KVCacheBlocks`` are the blocks handed to the engine, per group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.reference import rules
from pagedkv.spec import errors, types
from pagedkv.spec.hashing import HashedRequest, event_block_keys
from pagedkv.spec.snapshot import PoolSnapshot
from pagedkv.spec.stored_events import PER_CALL, check_block_stored_events
from pagedkv.spec.types import BlockHash, BlockHashWithGroupId, KVCacheEvent, make_block_hash_with_group_id

__all__ = ["KVCacheBlock", "KVCacheBlocks", "BlockPool"]


@dataclass(eq=False)
class KVCacheBlock:
    """One block: its id, how many hold it, its cache key if any. Compared by identity."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHashWithGroupId | None = None
    key_tokens: int = 0  # prompt tokens the key covers (KEYTOK-1); meaningful only while keyed

    @property
    def is_null(self) -> bool:
        """Whether this is the null block (id 0)."""
        return self.block_id == 0


class KVCacheBlocks:
    """``blocks[g][i]`` is the ``i``-th block (token order) of group ``g``."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        self.blocks: tuple[tuple[KVCacheBlock, ...], ...] = tuple(tuple(group) for group in blocks)

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, in token order."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks that carry no cache key now; ``InvalidArgumentError`` unless one group."""
        if len(self.blocks) != 1:
            raise errors.InvalidArgumentError(
                f"get_unhashed_block_ids needs exactly one KV cache group, have {len(self.blocks)}")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        if not isinstance(other, KVCacheBlocks):
            raise errors.InvalidArgumentError(
                f"only KVCacheBlocks of the same implementation add up; other is {type(other).__name__}")
        if len(self.blocks) != len(other.blocks):
            raise errors.InvalidArgumentError(
                f"cannot add KVCacheBlocks of {len(self.blocks)} and {len(other.blocks)} groups")
        return KVCacheBlocks([mine + theirs for mine, theirs in zip(self.blocks, other.blocks)])

    def new_empty(self) -> KVCacheBlocks:
        """As many groups, no blocks."""
        return KVCacheBlocks([() for _ in self.blocks])

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


class BlockPool:
    """The blocks every KV cache group shares; keys carry a group id in
    ``[0, num_groups)`` (CACHE-3); events are kept for :meth:`take_events`,
    ``BlockStored`` shaped as ``block_stored_events`` says (D-EVT-15).
    Raises ``InvalidConfigError``: a malformed argument."""

    def __init__(self, num_blocks: int, enable_caching: bool, *, enable_kv_cache_events: bool = False,
                 num_groups: int = 1, block_stored_events: str = PER_CALL) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise errors.InvalidConfigError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if type(num_groups) is not int or num_groups < 0:
            raise errors.InvalidConfigError(f"num_groups must be an int >= 0, got {num_groups!r}")
        self.block_stored_events = check_block_stored_events(block_stored_events)
        self.num_blocks, self.num_groups = num_blocks, num_groups
        self.enable_caching, self.enable_kv_cache_events = enable_caching, enable_kv_cache_events
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[0]
        # POOL-1: the null block never enters the free queue.
        self.free_queue: list[KVCacheBlock] = self.blocks[1:]
        self.cached: dict[BlockHashWithGroupId, list[KVCacheBlock]] = {}
        self.events: list[KVCacheEvent] = []
        # Blocks held for the pool's lifetime (attention sinks, D-SINK-1).
        self.reserved: list[KVCacheBlock] = []
        # Tokens past each block its hash covers, which events carry (spec/hashing.md §7).
        self.num_hash_lookahead_tokens = 0

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue, evictable cached blocks included."""
        return len(self.free_queue)

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (:func:`rules.usage`)."""
        return rules.usage(len(self.free_queue), self.num_blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """EVICT-1..5: take ``num_blocks`` free blocks, dropping their keys; each gets ref count 1.
        Raises ``PoolExhaustedError`` with fewer free blocks than asked for (no change)."""
        # EVICT-1: checked before anything moves.
        if type(num_blocks) is not int or num_blocks < 0:
            raise errors.InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_blocks > len(self.free_queue):
            raise errors.PoolExhaustedError(f"asked for {num_blocks} blocks, only {len(self.free_queue)} are free")
        popped = self.choose_victims(num_blocks)  # EVICT-2
        taken = {block.block_id for block in popped}
        self.free_queue = [block for block in self.free_queue if block.block_id not in taken]
        for block in popped:
            if self.enable_caching:
                self._evict(block)  # EVICT-3, EVICT-4
            block.ref_cnt = 1  # EVICT-5
        return popped

    def choose_victims(self, num_blocks: int) -> list[KVCacheBlock]:
        """EVICT-2: the victims, the front of the free queue (at most its length)."""
        return self.free_queue[:num_blocks]

    def reserve(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks for good (attention sinks, SINK-1)."""
        blocks = self.get_new_blocks(num_blocks)
        self.reserved.extend(blocks)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each non-null block (a hit); a free one leaves the queue."""
        for block in blocks:
            if not block.is_null:
                if block.ref_cnt == 0:
                    self.free_queue.remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """FREE-3..5: drop one reference per block, in order; blocks reaching zero are requeued."""
        blocks = [block for block in ordered_blocks if not block.is_null]
        # FREE-3, before any count moves: a block named k times needs a ref count >= k.
        for block in blocks:
            times = sum(1 for other in blocks if other is block)
            if block.ref_cnt < times:
                raise errors.InvariantViolation(
                    f"POOL-3: freeing block {block.block_id} {times} time(s) but its ref count is {block.ref_cnt}")
        # One pass, as vLLM's: released where its count reaches 0 (D-API-35).
        released: list[KVCacheBlock] = []
        for block in blocks:  # FREE-4
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        order = rules.requeue([block.block_id for block in self.free_queue], [block.block_id for block in released],
                              [block.block_hash is not None for block in released])  # FREE-5
        self.free_queue = [self.blocks[block_id] for block_id in order]

    def get_cached_block(self, block_hash: BlockHash, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """The first block cached under ``block_hash`` in each group, or ``None`` if one has none."""
        found = [self.cached.get(make_block_hash_with_group_id(block_hash, group_id)) for group_id in group_ids]
        return [blocks[0] for blocks in found if blocks] if all(found) else None

    def cache_full_blocks(self, request: HashedRequest, blocks: Sequence[KVCacheBlock], *,
                          block_hashes: Sequence[BlockHash], num_cached_blocks: int, num_full_blocks: int,
                          block_size: int, group_id: int, mask: Sequence[bool] | None = None) -> None:
        """Key blocks ``[num_cached_blocks, num_full_blocks)`` with the group's
        view of the hashes, skipping null, keyed and masked-out blocks (REQ-7,
        KEYTOK-1); one ``BlockStored`` for the call (vLLM's shape) or one per
        run of newly keyed blocks, as ``block_stored_events`` says (D-EVT-15)."""
        stored: list[int] = []
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null or block.block_hash is not None or (
                    mask is not None and not mask[index - num_cached_blocks]):
                continue
            key = make_block_hash_with_group_id(block_hashes[index], group_id)
            block.block_hash = key
            block.key_tokens = (index + 1) * block_size
            self.cached.setdefault(key, []).append(block)
            stored.append(index)
        if not self.enable_kv_cache_events or num_cached_blocks >= num_full_blocks:
            return
        if self.block_stored_events == PER_CALL:  # vLLM's shape: the range's tokens and parent, the new hashes
            spans = [(num_cached_blocks, num_full_blocks, stored)]
        else:  # maximal runs of consecutive positions, each its own chain segment
            spans = []
            for index in stored:
                if spans and spans[-1][1] == index:
                    spans[-1] = (spans[-1][0], index + 1, [*spans[-1][2], index])
                else:
                    spans.append((index, index + 1, [index]))
        for first, end, positions in spans:
            extra_keys, lookahead_token_ids = event_block_keys(
                request, positions, block_size, self.num_hash_lookahead_tokens)
            self.events.append(types.BlockStored(
                block_hashes=tuple(block_hashes[index] for index in positions),
                parent_block_hash=None if first == 0 else block_hashes[first - 1],
                token_ids=tuple(request.all_token_ids[first * block_size:end * block_size]), block_size=block_size,
                lora_id=request.lora_id, lora_name=request.lora_name, group_idx=group_id,
                session_id=getattr(request, "session_id", None), extra_keys=extra_keys,
                lookahead_token_ids=lookahead_token_ids))

    def key_tokens(self, block_id: int) -> int | None:
        """Tokens the key of block ``block_id`` covers (KEYTOK-1); ``None`` unkeyed."""
        block = self.blocks[block_id]
        return None if block.block_hash is None else block.key_tokens

    def _evict(self, block: KVCacheBlock) -> None:
        """EVICT-3, EVICT-4: drop a block's key, if any, with a ``BlockRemoved`` event."""
        key = block.block_hash
        if key is None:
            return
        holders = self.cached[key]
        holders.remove(block)
        if not holders:
            del self.cached[key]
        block.block_hash = None
        if self.enable_kv_cache_events:
            self.events.append(types.BlockRemoved(block_hashes=(types.get_block_hash(key),),
                                                  group_idx=types.get_group_id(key)))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the keys of the given blocks, in order; blocks stay where they are.
        Raises ``UnknownBlockError``: an id outside ``[0, num_blocks)`` (no change)."""
        ids = list(block_ids)
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
                raise errors.UnknownBlockError(f"block id {block_id!r} is not in [0, {self.num_blocks})")
        for block_id in ids:
            self._evict(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """RESET-1..3: drop every key if no block but sinks is in use (D-SINK-2)."""
        if any(block.ref_cnt > 0 and all(block is not kept for kept in self.reserved) for block in self.blocks[1:]):
            return False  # RESET-1
        self.cached.clear()  # RESET-2
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:  # RESET-3
            self.events.append(types.AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Pending events, oldest first; the queue is emptied."""
        events, self.events = self.events, []
        return events

    def snapshot(self) -> PoolSnapshot:
        """Observable state (spec/state.md)."""
        return PoolSnapshot(
            num_blocks=self.num_blocks, block_hashes=tuple(block.block_hash for block in self.blocks),
            ref_counts=tuple(0 if block.is_null else block.ref_cnt for block in self.blocks),
            free_queue=tuple(block.block_id for block in self.free_queue), pending_events=tuple(self.events),
            cached=tuple(sorted((key, tuple(block.block_id for block in holders))
                                for key, holders in self.cached.items())))
