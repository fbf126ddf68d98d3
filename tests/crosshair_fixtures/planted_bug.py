"""A planted bug: block counting with floor division instead of ceiling.

``make crosshair`` requires CrossHair to report a counterexample here; if it
ever stops doing so, the gate itself is broken and fails.
"""

from __future__ import annotations


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (WRONG on purpose).

    pre: num_tokens >= 0
    pre: block_size > 0
    post: __return__ * block_size >= num_tokens
    """
    return num_tokens // block_size
