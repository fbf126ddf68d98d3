"""The hybrid hit search: the longest prefix every KV cache group can serve
(LOOKUP-3, held to the reference's search by HYB-1).

Definition (the reference's brute force, spec/coordinators.md): the largest
``L <= cap``, a multiple of the alignment ``A`` (the LCM of the block
sizes), at which every group's ``can_hit`` holds; ``L = 0`` always
qualifies. The reference tries every aligned length from the cap down.

Here: a fixed-point iteration. Start from ``L = cap`` aligned down; each
group in turn lowers ``L`` to its own longest hit at most ``L``
(``SingleTypeManager.longest_hit``); stop once every group has
confirmed the current ``L``. Why it is the largest common hit: any common
hit ``L' <= cap`` is a hit of every group, so each group's answer under a
bound ``>= L'`` is ``>= L'`` and ``L`` never drops below ``L'``; at the
fixed point every group can hit ``L`` itself.

Why it is fast: a full-attention group's answer is final after one call
(its cached prefix is scanned once and every shorter aligned length
qualifies), so full groups go first and usually fix ``L`` outright; window
groups (sliding window, chunked local, Mamba) then check one span each, and
jump past a miss instead of stepping one alignment at a time. A group that
can only serve the empty hit (cross-attention, Mamba ``none``) ends the
search at once.

Group hash views: a group of block size ``b`` sees the request's hashes
(computed at the hash block size ``h``) as the concatenation of each
``b / h`` consecutive hashes (D-HASH-5); views are built once per distinct
block size and only as far as the cap needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.single_type import FullAttentionManager, SingleTypeManager
from pagedkv.spec.types import BlockHash

__all__ = ["group_view", "HashViews", "longest_common_hit"]


def group_view(block_hashes: Sequence[BlockHash], scale: int, num_blocks: int | None = None) -> list[BlockHash]:
    """The first ``num_blocks`` (default: all) hashes at ``scale`` times the
    hash block size: each is the concatenation of ``scale`` consecutive
    hashes. Cost: O(blocks of the view)."""
    count = len(block_hashes) // scale
    if num_blocks is not None and num_blocks < count:
        count = num_blocks
    if scale == 1:
        return list(block_hashes[:count])
    join = b"".join
    return [BlockHash(join(block_hashes[index * scale:(index + 1) * scale])) for index in range(count)]


class HashViews:
    """A request's hash views per block size, built on first use.

    ``HashViews(block_hashes, hash_block_size, max_tokens)``: views reach
    no further than ``max_tokens`` tokens plus one block (the EAGLE peek),
    all a search bounded by ``max_tokens`` can read.
    """

    __slots__ = ("block_hashes", "hash_block_size", "max_tokens", "_views")

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int,
                 max_tokens: int | None = None) -> None:
        self.block_hashes = block_hashes
        self.hash_block_size = hash_block_size
        self.max_tokens = max_tokens
        self._views: dict[int, Sequence[BlockHash]] = {}

    def at(self, block_size: int) -> Sequence[BlockHash]:
        """The view at ``block_size`` (the request's own list when it is the
        hash block size). Cost: O(1) cached, O(blocks of the view) first."""
        view = self._views.get(block_size)
        if view is None:
            scale = block_size // self.hash_block_size
            if scale == 1:
                view = self.block_hashes
            else:
                limit = None if self.max_tokens is None else self.max_tokens // block_size + 1
                view = group_view(self.block_hashes, scale, limit)
            self._views[block_size] = view
        return view


def longest_common_hit(managers: Sequence[SingleTypeManager], views: HashViews,
                       max_length: int, alignment: int, peek_limit: int | None = None) -> int:
    """The largest common hit (see the module docstring); ``managers`` in
    group order; an EAGLE group's given-back block ends by ``peek_limit``
    (default ``max_length``; D-SWA-15). Pure: touches nothing.

    Cost: one cached-prefix scan per full group, then about one hit span
    per window group per lowering of ``L`` (misses are jumped over).
    """
    length = max_length // alignment * alignment
    if length <= 0:
        return 0
    peek = max_length if peek_limit is None else peek_limit
    hashed = len(views.block_hashes) * views.hash_block_size
    window_groups: list[SingleTypeManager] = []
    for manager in managers:
        if manager.always_empty_hit:
            return 0
        if isinstance(manager, FullAttentionManager):
            # Final after one call: a lower bound only clips it.
            length = manager.longest_hit(views.at(manager.block_size), length,
                                         manager.lookup_limit(max_length, peek, hashed))
            if length == 0:
                return 0
        else:
            window_groups.append(manager)
    count = len(window_groups)
    confirmed = 0
    index = 0
    while confirmed < count:
        manager = window_groups[index]
        found = manager.longest_hit(views.at(manager.block_size), length,
                                    manager.lookup_limit(max_length, peek, hashed))
        if found < length:
            if found == 0:
                return 0
            length = found
            confirmed = 1
        else:
            confirmed += 1
        index = index + 1 if index + 1 < count else 0
    return length
