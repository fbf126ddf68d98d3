"""How a ``cache_full_blocks`` call reports what it cached (spec/operations.md,
``cache_full_blocks``; D-EVT-15).

Two shapes, chosen by the pool's ``block_stored_events`` option:

- ``"per_call"`` (the default, vLLM 0.33's): one ``BlockStored`` for every
  call with a non-empty range. Its hashes are those of the positions the call
  newly keyed, in order; its parent is the hash of the position before the
  range, its tokens those of the whole range. Where null or masked positions
  leave gaps (sliding window in a hybrid, Mamba ``align``) hashes and tokens
  do not line up, and a call that keyed nothing still sends an event with no
  hash.
- ``"per_run"`` (opt-in): one ``BlockStored`` per maximal run of consecutive
  newly keyed positions, each a valid chain segment (parent = hash of the
  position before the run, tokens of the run), none when nothing was keyed.

For a call without gaps that keys something the two agree. This module is
vocabulary only: the option's values and the check that refuses any other
(both pools call it); each implementation builds its events itself.
"""

from __future__ import annotations

from typing import Final

from pagedkv.spec.errors import InvalidConfigError

__all__ = [
    "PER_CALL",
    "PER_RUN",
    "BLOCK_STORED_EVENTS",
    "check_block_stored_events",
]

PER_CALL: Final = "per_call"
"""One ``BlockStored`` per ``cache_full_blocks`` call, as vLLM 0.33 sends."""

PER_RUN: Final = "per_run"
"""One ``BlockStored`` per contiguous run of newly keyed positions (opt-in)."""

BLOCK_STORED_EVENTS: Final = (PER_CALL, PER_RUN)
"""The accepted values of the ``block_stored_events`` option, default first."""


def check_block_stored_events(value: object) -> str:
    """``value`` if it is one of :data:`BLOCK_STORED_EVENTS`.

    Raises:
        InvalidConfigError: anything else (names the option and its values).
    """
    if type(value) is not str or value not in BLOCK_STORED_EVENTS:
        raise InvalidConfigError(
            f"block_stored_events must be one of {list(BLOCK_STORED_EVENTS)}, got {value!r}")
    return value

