"""The arithmetic and ordering rules of the block manager, as pure functions.
Every rule is small, total on its precondition and carries a PEP 316
contract (``pre:`` / ``post:``) that CrossHair checks symbolically (``make
crosshair``). The stateful classes of the reference call these rules instead
of restating them, so the contracts cover the decisions the reference makes
(spec/operations.md cites each rule by name).
"""

from __future__ import annotations

from pagedkv.spec import sizing

__all__ = ["cdiv", "num_new_blocks_needed", "requeue", "usage", "common_prefix_blocks", "max_hit_tokens",
           "sliding_window_skipped_tokens", "chunked_local_skipped_tokens", "contiguous_blocks_for_hit",
           "hit_alignment"]


cdiv = sizing.cdiv  # shared vocabulary (its contract is checked there too)


def num_new_blocks_needed(num_tokens: int, block_size: int, num_held: int) -> int:
    """Blocks a group holding ``num_held`` must add so that ``num_tokens`` tokens have
    a slot (never negative: a request keeps blocks it allocated for rejected draft tokens).

    pre: num_tokens >= 0
    pre: block_size > 0
    pre: num_held >= 0
    post: __return__ >= 0
    post: (num_held + __return__) * block_size >= num_tokens
    post: __return__ == 0 or (num_held + __return__ - 1) * block_size < num_tokens
    """
    return max(cdiv(num_tokens, block_size) - num_held, 0)


def max_hit_tokens(num_tokens: int) -> int:
    """The longest prefix a hit may cover: the last token is always recomputed (its logits).

    pre: num_tokens >= 1
    post: __return__ == num_tokens - 1
    post: 0 <= __return__ < num_tokens
    """
    return num_tokens - 1


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
    """Leading blocks of one request that every known request holds: those
    whose ref count equals the number of requests holding blocks.

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


def sliding_window_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    """Leading tokens outside the window of the next token (the ``sliding_window`` tokens ending with it).

    pre: num_computed_tokens >= 0
    pre: sliding_window >= 1
    post: 0 <= __return__ <= num_computed_tokens
    post: num_computed_tokens - __return__ <= sliding_window - 1
    """
    return max(0, num_computed_tokens - sliding_window + 1)


def chunked_local_skipped_tokens(num_computed_tokens: int, chunk_size: int) -> int:
    """Leading tokens before the chunk the next token falls in.

    pre: num_computed_tokens >= 0
    pre: chunk_size >= 1
    post: __return__ % chunk_size == 0
    post: __return__ <= num_computed_tokens < __return__ + chunk_size
    """
    return num_computed_tokens // chunk_size * chunk_size


def contiguous_blocks_for_hit(sliding_window: int, block_size: int) -> int:
    """Cached blocks a sliding-window hit needs right before its end: enough
    to cover the ``sliding_window - 1`` tokens the next token reads.

    pre: sliding_window >= 1
    pre: block_size >= 1
    post: __return__ * block_size >= sliding_window - 1
    post: __return__ == 0 or (__return__ - 1) * block_size < sliding_window - 1
    """
    return cdiv(sliding_window - 1, block_size)


def hit_alignment(block_sizes: list[int]) -> int:
    """Hit lengths of a hybrid model: multiples of every group's block size, their LCM (1 with no groups).

    pre: all(size >= 1 for size in block_sizes)
    post: __return__ >= 1
    post: all(__return__ % size == 0 for size in block_sizes)
    """
    alignment = 1
    for size in block_sizes:
        alignment = alignment * size // _gcd(alignment, size)
    return alignment


def _gcd(a: int, b: int) -> int:
    """Euclid's algorithm.

    pre: a >= 1 and b >= 1
    post: __return__ >= 1 and a % __return__ == 0 and b % __return__ == 0
    """
    while b:
        a, b = b, a % b
    return a
