"""The EAGLE rules of the reference, one function per question
(spec/coordinators.md section 4.1). Written apart from
``pagedkv.optimized``'s (this mask compares every pair of groups) so the
lockstep machines compare two statements of each rule.

A drafting model gives back the last block of a prefix hit, because the
draft head must recompute that block's last token. Three questions follow:

- Which groups give a block back (:func:`eagle_group_mask`)? Those the
  model marks as draft groups, or all of them when it marks none; a group
  looked up together with a marked one (the same spec) follows it
  (D-SWA-14).
- How far may a group look for the block it gives back
  (:func:`eagle_peek_limit`)? Up to the hit cap when it is the only group;
  with others, as far as the request's hashed tokens reach (D-SWA-15).
- And a full-attention group that hits inside its own blocks
  (:func:`sub_block_eagle_limit`)? One hash block past the cap, at most
  (FPART-5, D-MAMBA-38).

Mamba's sparse retention under EAGLE (D-MAMBA-35) is stated with the other
publication rules, in :mod:`pagedkv.reference.features.mamba_checkpoint_rules`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["eagle_group_mask", "eagle_peek_limit", "sub_block_eagle_limit"]


def eagle_group_mask(marked: Sequence[bool], sibling_keys: Sequence[Hashable], use_eagle: bool) -> tuple[bool, ...]:
    """For each group (``marked[g]``: its ``is_eagle_group``), whether it
    follows the EAGLE hit rule, before a manager type's own exemption (Mamba
    and cross-attention never follow it). Without ``use_eagle`` no group
    does. With it, every group does when none is marked; otherwise a group
    does when a marked group has its ``sibling_keys`` entry, itself
    included: such groups are looked up and cached as one (D-SWA-14).

    pre: len(sibling_keys) == len(marked)
    post: len(__return__) == len(marked) and (use_eagle or True not in __return__)
    post: not use_eagle or all(flag for flag, mark in zip(__return__, marked) if mark or True not in marked)
    """
    groups = range(len(marked))
    if not use_eagle:
        return tuple(False for _ in groups)
    if not any(marked):
        return tuple(True for _ in groups)
    # A group applies the rule when some marked group shares its key (itself included).
    return tuple(any(marked[other] and sibling_keys[other] == sibling_keys[group] for other in groups)
                 for group in groups)


def eagle_peek_limit(max_length: int, num_hashed_tokens: int, num_groups: int) -> int:
    """How far a group may look for the block it gives back. Alone, it stays
    within the hit cap ``max_length``. Beside other groups it reads on to the
    end of the hashed tokens when those pass the cap: vLLM 0.33's hybrid
    coordinator reads the block after a hit at the cap and gives that one
    back, so a resend of an aligned prompt keeps its last aligned block
    (D-SWA-15). It never looks short of the cap.

    pre: num_groups >= 0 and max_length >= 0 and num_hashed_tokens >= 0
    post: __return__ == max_length or (num_groups > 1 and __return__ > max_length)
    """
    several_groups = num_groups > 1
    return max_length if not several_groups or num_hashed_tokens < max_length else num_hashed_tokens


def sub_block_eagle_limit(max_length: int, num_hashed_tokens: int, hash_block_size: int) -> int:
    """The lookup bound of an EAGLE full-attention group whose block holds
    several hash blocks (FPART-5): it may match up to one hash block beyond
    the hit cap before giving one hash block back, and no further than the
    request is hashed. This is vLLM 0.33's exact bound, not the wider peek of
    :func:`eagle_peek_limit`: the tail block a hit inside a block uses
    (FPART-1) depends on it.

    pre: hash_block_size > 0 and max_length >= 0 and num_hashed_tokens >= 0
    post: __return__ <= min(num_hashed_tokens, max_length + hash_block_size)
    """
    one_hash_block_past_the_cap = max_length + hash_block_size
    return num_hashed_tokens if num_hashed_tokens < one_hash_block_past_the_cap else one_hash_block_past_the_cap
