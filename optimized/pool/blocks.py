"""KVCacheBlocks: the blocks an allocation or a prefix hit hands the engine.

Semantic model: per KV cache group, a list of block ids in token order
(``blocks[g][j]`` is group ``g``'s ``j``-th block). It is a value handed
across the manager boundary: the engine reads it, adds two together, or
passes a prefix hit back into ``allocate_slots``. The lists are never
mutated after construction (a shared empty instance relies on that), and
:meth:`get_block_ids` returns copies.
"""

from __future__ import annotations

from typing import Self

from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.types import BlockHash

__all__ = ["KVCacheBlocks"]


class KVCacheBlocks:
    """Block ids per KV cache group.

    ``KVCacheBlocks(blocks, block_hashes)``: ``blocks`` is a tuple of one
    id list per group; ``block_hashes`` is the owning pool's live hash list
    (read by :meth:`get_unhashed_block_ids`).
    """

    __slots__ = ("blocks", "_block_hashes")

    def __init__(self, blocks: tuple[list[int], ...],
                 block_hashes: list[BlockHash | None]) -> None:
        self.blocks = blocks
        self._block_hashes = block_hashes

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, in token order (fresh lists).

        Cost: O(blocks).
        """
        return tuple([list(group) for group in self.blocks])

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks (single group only) that carry no hash now.

        Cost: O(blocks).

        Raises:
            InvalidArgumentError: not exactly one group.
        """
        if len(self.blocks) != 1:
            raise InvalidArgumentError(
                f"get_unhashed_block_ids needs exactly one KV cache group, got {len(self.blocks)}")
        hashes = self._block_hashes
        return [block for block in self.blocks[0] if hashes[block] is None]

    def __add__(self, other: Self) -> Self:
        """Group-wise concatenation (a new object). Cost: O(blocks).

        Raises:
            InvalidArgumentError: the group counts differ.
        """
        if not isinstance(other, KVCacheBlocks):
            raise InvalidArgumentError(
                f"only KVCacheBlocks of the same implementation add up; other is {type(other).__name__}")
        if len(self.blocks) != len(other.blocks):
            raise InvalidArgumentError(
                f"cannot add KVCacheBlocks of {len(self.blocks)} and {len(other.blocks)} groups")
        return type(self)(
            tuple([a + b for a, b in zip(self.blocks, other.blocks)]), self._block_hashes)

    def new_empty(self) -> Self:
        """The same number of groups, no blocks. Cost: O(groups)."""
        return type(self)(tuple([[] for _ in self.blocks]), self._block_hashes)

    def __len__(self) -> int:
        """Blocks of group 0 (0 with no groups). Cost: O(1)."""
        return len(self.blocks[0]) if self.blocks else 0

    def __eq__(self, other: object) -> bool:
        """Equal when the block ids per group are equal (any implementation
        offering ``get_block_ids``). Cost: O(blocks)."""
        get_ids = getattr(other, "get_block_ids", None)
        if get_ids is None:
            return NotImplemented
        return tuple(list(g) for g in self.blocks) == tuple(get_ids())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.blocks!r})"
