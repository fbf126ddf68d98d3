"""The arithmetic and ordering rules of the block manager, as pure functions.

Every rule here is small, total on its precondition and carries a PEP 316
contract (``pre:`` / ``post:``) that CrossHair checks symbolically
(``make crosshair``). The stateful classes of the reference call these rules
instead of restating them, so the contracts cover the decisions the
reference makes (spec/operations.md cites each rule by name).
"""

from __future__ import annotations

__all__ = [
    "cdiv",
    "num_new_blocks_needed",
    "prefix_hit_blocks",
    "requeue",
    "usage",
    "common_prefix_blocks",
    "max_hit_tokens",
]


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: the number of blocks that hold ``numerator`` tokens.

    pre: numerator >= 0
    pre: denominator > 0
    post: __return__ * denominator >= numerator
    post: __return__ == 0 or (__return__ - 1) * denominator < numerator
    """
    return -(-numerator // denominator)


def num_new_blocks_needed(num_tokens: int, block_size: int, num_held: int) -> int:
    """Blocks a group must add so that ``num_tokens`` tokens have a slot,
    given it already holds ``num_held`` blocks (never negative: a request
    keeps blocks it allocated for rejected draft tokens).

    pre: num_tokens >= 0
    pre: block_size > 0
    pre: num_held >= 0
    post: __return__ >= 0
    post: (num_held + __return__) * block_size >= num_tokens
    post: __return__ == 0 or (num_held + __return__ - 1) * block_size < num_tokens
    """
    return max(cdiv(num_tokens, block_size) - num_held, 0)


def max_hit_tokens(num_tokens: int) -> int:
    """The longest prefix a hit may cover: the last token is always
    recomputed, because the engine needs its logits.

    pre: num_tokens >= 1
    post: __return__ == num_tokens - 1
    post: 0 <= __return__ < num_tokens
    """
    return num_tokens - 1


def prefix_hit_blocks(is_cached: list[bool], max_blocks: int, drop_last: bool) -> int:
    """How many leading blocks a full-attention hit serves.

    ``is_cached[i]`` says whether block ``i``'s hash is in the cache. The hit
    is the longest all-cached prefix of at most ``max_blocks`` blocks; with
    ``drop_last`` (EAGLE/MTP) one matched block is given back so the drafter
    sees its hidden states recomputed.

    pre: max_blocks >= 0
    post: 0 <= __return__ <= max_blocks
    post: __return__ <= len(is_cached)
    post: all(is_cached[:__return__])
    post: drop_last or __return__ == min(max_blocks, len(is_cached)) or not is_cached[__return__]
    post: not drop_last or __return__ + 1 == min(max_blocks, len(is_cached)) or __return__ == 0 or not is_cached[__return__ + 1]
    """
    limit = min(max_blocks, len(is_cached))
    hit = 0
    while hit < limit and is_cached[hit]:
        hit += 1
    if drop_last and hit > 0:
        hit -= 1
    return hit


def requeue(queue: list[int], released: list[int], hashed: list[bool]) -> list[int]:
    """The free queue after ``released`` blocks (in release order) reach ref
    count zero: unhashed ones go to the front as a batch in release order
    (nothing can hit them, so reuse them first); hashed ones go to the back
    in release order (least recently used first out).

    pre: len(released) == len(hashed)
    post: len(__return__) == len(queue) + len(released)
    post: __return__[:hashed.count(False)] == [b for b, h in zip(released, hashed) if not h]
    post: __return__[hashed.count(False):hashed.count(False) + len(queue)] == queue
    post: __return__[hashed.count(False) + len(queue):] == [b for b, h in zip(released, hashed) if h]
    """
    front = [block for block, has_hash in zip(released, hashed) if not has_hash]
    back = [block for block, has_hash in zip(released, hashed) if has_hash]
    return front + queue + back


def usage(num_free: int, num_blocks: int) -> float:
    """Fraction of usable blocks (all but the null block) in use.

    pre: num_blocks >= 1
    pre: 0 <= num_free <= num_blocks - 1
    post: 0.0 <= __return__ <= 1.0
    post: num_blocks == 1 or (__return__ == 0.0) == (num_free == num_blocks - 1)
    """
    if num_blocks == 1:
        return 0.0
    return 1.0 - num_free / (num_blocks - 1)


def common_prefix_blocks(ref_counts: list[int], num_requests: int) -> int:
    """Leading blocks of one request that every known request holds: the
    blocks whose ref count equals the number of requests holding blocks.

    pre: num_requests >= 1
    post: 0 <= __return__ <= len(ref_counts)
    post: all(count == num_requests for count in ref_counts[:__return__])
    post: __return__ == len(ref_counts) or ref_counts[__return__] != num_requests
    """
    common = 0
    for count in ref_counts:
        if count != num_requests:
            break
        common += 1
    return common
