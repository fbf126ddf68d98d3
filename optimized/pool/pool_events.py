"""The ``BlockStored`` events of one caching call (spec/operations.md, D-EVT-2, D-EVT-10).

Split from :mod:`block_pool` to keep that module about the pool itself: the
pool collects runs of newly hashed positions, this turns each run into one
event with what a KV-aware router needs to rebuild the hashes.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.hashing import HashedRequest, event_block_keys
from pagedkv.spec.types import MEDIUM_GPU, BlockHash, BlockStored

__all__ = ["stored_events"]


def stored_events(request: HashedRequest, runs: Sequence[tuple[int, list[BlockHash]]],
                  block_hashes: Sequence[BlockHash], block_size: int, group_id: int,
                  num_hash_lookahead_tokens: int) -> list[BlockStored]:
    """One ``BlockStored`` per run ``(first position, hashes)`` of newly cached
    blocks of ``group_id``, in run order. Cost: O(tokens in the runs)."""
    events = []
    for first, run in runs:
        extra_keys, lookahead_token_ids = event_block_keys(
            request, first, first + len(run), block_size, num_hash_lookahead_tokens)
        events.append(BlockStored(
            block_hashes=tuple(run),
            parent_block_hash=None if first == 0 else block_hashes[first - 1],
            token_ids=tuple(request.all_token_ids[first * block_size:
                                                  (first + len(run)) * block_size]),
            block_size=block_size,
            lora_id=request.lora_id,
            medium=MEDIUM_GPU,
            lora_name=request.lora_name,
            group_idx=group_id,
            session_id=getattr(request, "session_id", None),
            extra_keys=extra_keys,
            lookahead_token_ids=lookahead_token_ids,
        ))
    return events
