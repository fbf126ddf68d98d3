"""EAGLE per KV-cache group: its rules (spec/coordinators.md section 4.1).

The optimized implementation's copy; the reference states them again in
``pagedkv.reference.features``:

- :func:`eagle_group_mask`: which groups apply the EAGLE hit rule. A model
  marks its draft groups (``KVCacheGroupSpec.is_eagle_group``); with none
  marked every group is a draft group. Groups sharing one spec are looked up
  and cached together, so one marked member marks its siblings (D-SWA-14).
- :func:`eagle_peek_limit`: how far an EAGLE group may look for the block it
  gives back. With several groups the peek may pass the hit cap up to the
  hashed tokens (D-SWA-15); one group keeps the cap.
- :func:`sub_block_eagle_limit`: how far an EAGLE full-attention group that
  hits inside its own blocks looks before giving one hash block back
  (FPART-5, D-MAMBA-38).
The Mamba sparse-retention rule (D-MAMBA-35) lives with the other Mamba
publication rules in :mod:`pagedkv.optimized.rules.mamba_checkpoint_rules`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["eagle_group_mask", "eagle_peek_limit", "sub_block_eagle_limit"]


def eagle_group_mask(marked: Sequence[bool], sibling_keys: Sequence[Hashable], use_eagle: bool) -> tuple[bool, ...]:
    """Per group, whether the EAGLE hit rule applies to it (before the
    manager type's own exemption: Mamba and cross-attention never apply it).

    ``marked[g]`` is group ``g``'s ``is_eagle_group``; ``sibling_keys[g]``
    identifies the groups that are searched and cached as one (same spec).
    Off without ``use_eagle``; with it and no group marked, every group; else
    the marked groups and every group sharing a key with one of them.

    pre: len(marked) == len(sibling_keys)
    post: len(__return__) == len(marked)
    post: use_eagle or not any(__return__)
    post: not use_eagle or any(marked) or all(__return__)
    post: all(flag for flag, mark in zip(__return__, marked) if mark) or not use_eagle
    """
    count = len(marked)
    if not use_eagle:
        return tuple(False for _ in range(count))
    if not any(marked):
        return tuple(True for _ in range(count))
    keys = {sibling_keys[index] for index in range(count) if marked[index]}
    return tuple(bool(marked[index]) or sibling_keys[index] in keys for index in range(count))


def eagle_peek_limit(max_length: int, num_hashed_tokens: int, num_groups: int) -> int:
    """The furthest token an EAGLE group's given-back block may reach: the
    hit cap ``max_length`` with one group; with several, the hashed tokens
    (the block after a hit at the cap is read and given back, as vLLM 0.33's
    hybrid coordinator does, so an aligned resend keeps its last aligned
    block: D-SWA-15), never below the cap.

    pre: max_length >= 0 and num_hashed_tokens >= 0 and num_groups >= 0
    post: __return__ >= max_length
    post: num_groups > 1 or __return__ == max_length
    """
    if num_groups <= 1:
        return max_length
    return max(max_length, num_hashed_tokens)


def sub_block_eagle_limit(max_length: int, num_hashed_tokens: int, hash_block_size: int) -> int:
    """How far an EAGLE full-attention group with sub-block hits (a block
    larger than the hash block, FPART-5) may match before it gives back one
    hash block: one hash block past the hit cap, never past the hashed
    tokens -- vLLM 0.33's lookup bound for such a group. Which tail block a
    hit inside a block uses depends on this bound (FPART-1), so it is the
    exact bound, not the wider D-SWA-15 peek.

    pre: max_length >= 0 and num_hashed_tokens >= 0 and hash_block_size > 0
    post: __return__ <= num_hashed_tokens
    post: __return__ <= max_length + hash_block_size
    """
    return min(max_length + hash_block_size, num_hashed_tokens)
