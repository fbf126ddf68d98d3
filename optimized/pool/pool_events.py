"""The ``BlockStored`` events of one caching call (spec/operations.md, D-EVT-10, D-EVT-15).

Split from :mod:`block_pool` to keep that module about the pool itself: the
pool collects runs of newly hashed positions, this turns them into events
with what a KV-aware router needs to rebuild the hashes: one for the whole
call (vLLM's shape, the default) or one per run (the opt-in split).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.hashing import HashedRequest, event_block_keys
from pagedkv.spec.types import MEDIUM_GPU, BlockHash, BlockStored

__all__ = ["stored_events"]


def stored_events(request: HashedRequest, runs: Sequence[tuple[int, list[BlockHash]]],
                  block_hashes: Sequence[BlockHash], block_size: int, group_id: int,
                  num_hash_lookahead_tokens: int,
                  call: tuple[int, int] | None = None) -> list[BlockStored]:
    """The ``BlockStored`` events for the runs ``(first position, hashes)`` of
    blocks of ``group_id`` a call newly cached, in run order. With ``call``
    (the call's range ``(num_cached_blocks, num_full_blocks)``), one event
    for the whole range: every run's hashes, the tokens and parent of the
    range, even with no run. Without, one event per run. Cost: O(tokens in
    the range or the runs)."""
    spans: list[tuple[int, int, list[int], list[BlockHash]]]
    if call is not None:
        positions = [first + offset for first, run in runs for offset in range(len(run))]
        spans = [(call[0], call[1], positions, [h for _, run in runs for h in run])]
    else:
        spans = [(first, first + len(run), list(range(first, first + len(run))), run)
                 for first, run in runs]
    events = []
    for first, end, positions, hashes in spans:
        extra_keys, lookahead_token_ids = event_block_keys(
            request, positions, block_size, num_hash_lookahead_tokens)
        events.append(BlockStored(
            block_hashes=tuple(hashes),
            parent_block_hash=None if first == 0 else block_hashes[first - 1],
            token_ids=tuple(request.all_token_ids[first * block_size:end * block_size]),
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
