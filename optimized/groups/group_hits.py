"""Per-group prefix hits, not reconciled across groups.

The hybrid search (``hybrid_search``) answers the longest prefix *every*
group can serve. Two engine questions need each group's own answer:

- a KV connector reads each group's hit apart, since it can supply what a
  lagging group misses (``find_longest_cache_hit_per_group``);
- the shared-prefix boundary: when the leading group (the first
  full-attention group, else group 0) hits further than the common hit, a
  prefix shared with an earlier request is cached densely but not by a
  sparse-retention group. The engine pins that junction on the new request
  so its window tail there is kept (spec/operations.md, D-SWA-11).

Example (full attention + sliding window 16, block 16, retention 0): request
A ``[shared 64 | a 64]`` caches full blocks 0-7 and only its replay tail in
the window group; request B ``[shared 64 | b 64]`` hits 64 tokens in the full
group and 0 in the window group: common hit 0, uncached shared prefix 64.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.optimized.groups.hybrid_search import HashViews
from pagedkv.optimized.groups.single_type import FullAttentionManager, SingleTypeManager

__all__ = ["per_group_hits", "uncached_shared_prefix"]


def per_group_hits(managers: Sequence[SingleTypeManager], views: HashViews, max_length: int,
                   alignment: int, peek_limit: int | None = None
                   ) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
    """Each group's largest aligned hit ``L <= max_length`` it alone can
    serve, and its blocks; an EAGLE group peeks up to ``peek_limit``
    (default ``max_length``, D-SWA-15). Pure. Cost: one ``longest_hit`` per
    group plus the hit blocks."""
    peek = max_length if peek_limit is None else peek_limit
    hashed = len(views.block_hashes) * views.hash_block_size
    cap = max_length // alignment * alignment
    blocks: list[list[int]] = []
    lengths: list[int] = []
    for manager in managers:
        length = 0
        limit = manager.lookup_limit(max_length, peek, hashed)
        if cap > 0 and not manager.always_empty_hit:
            length = manager.longest_hit(views.at(manager.block_size), cap, limit)
        blocks.append(manager.hit_blocks(views.at(manager.block_size), length, limit) if length else [])
        lengths.append(length)
    return tuple(blocks), tuple(lengths)


def uncached_shared_prefix(managers: Sequence[SingleTypeManager], views: HashViews, max_length: int,
                           alignment: int, hit_length: int, peek_limit: int | None = None) -> int:
    """Tokens the leading group hits beyond ``hit_length`` (0 if none).
    Pure. Cost: one ``longest_hit`` search of the leading group."""
    leading = next((manager for manager in managers if isinstance(manager, FullAttentionManager)),
                   managers[0])
    cap = max_length // alignment * alignment
    if cap <= hit_length or leading.always_empty_hit:
        return 0
    peek = max_length if peek_limit is None else peek_limit
    found = leading.longest_hit(views.at(leading.block_size), cap,
                                leading.lookup_limit(max_length, peek, len(views.block_hashes) * views.hash_block_size))
    return found - hit_length if found > hit_length else 0
