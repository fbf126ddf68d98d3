"""``KVCacheBlocks``: blocks handed to the engine, per KV cache group."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.reference.block_pool import KVCacheBlock
from pagedkv.spec.errors import InvalidArgumentError

__all__ = ["KVCacheBlocks"]


class KVCacheBlocks:
    """``blocks[g][i]`` is the ``i``-th block (token order) of group ``g``."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        self.blocks: tuple[tuple[KVCacheBlock, ...], ...] = tuple(tuple(group) for group in blocks)

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, in token order."""
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks that carry no cache key now (one group only).

        Raises:
            InvalidArgumentError: not exactly one group.
        """
        if len(self.blocks) != 1:
            raise InvalidArgumentError(
                f"get_unhashed_block_ids needs exactly one KV cache group, have {len(self.blocks)}")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        if not isinstance(other, KVCacheBlocks):
            raise InvalidArgumentError(
                f"only KVCacheBlocks of the same implementation add up; other is {type(other).__name__}")
        if len(self.blocks) != len(other.blocks):
            raise InvalidArgumentError(
                f"cannot add KVCacheBlocks of {len(self.blocks)} and {len(other.blocks)} groups")
        return KVCacheBlocks([mine + theirs for mine, theirs in zip(self.blocks, other.blocks)])

    def new_empty(self) -> KVCacheBlocks:
        """As many groups, no blocks."""
        return KVCacheBlocks([() for _ in self.blocks])

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"
