"""Typed errors shared by every pagedkv implementation.

Every refused operation raises one of these *before* it changes any state
(spec/operations.md, "Error behaviour"). Each class subclasses ``ValueError``
(the caller passed something wrong) or ``RuntimeError`` (the manager cannot do
it now), so engines that already catch those keep working.
"""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "InvalidArgumentError",
    "InvalidTokenCountError",
    "ExceedsMaxModelLenError",
    "UnknownRequestError",
    "UnknownBlockError",
    "InvalidConfigError",
    "IncompatibleSpecError",
    "InsufficientMemoryError",
    "PoolExhaustedError",
    "InvariantViolation",
    "InvalidRetentionError",
    "PinBudgetExceededError",
]


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument is malformed: wrong type, out of range, inconsistent."""


class InvalidTokenCountError(InvalidArgumentError):
    """A token count is zero where one is required, or negative."""


class ExceedsMaxModelLenError(InvalidArgumentError):
    """An allocation would give a request more tokens than ``max_model_len``."""


class UnknownRequestError(PagedKVError, ValueError):
    """The request id holds no allocation in this manager (never allocated,
    or already freed)."""


class UnknownBlockError(PagedKVError, ValueError):
    """A block id is outside ``[0, num_blocks)``."""


class InvalidConfigError(PagedKVError, ValueError):
    """A KV cache spec or configuration is malformed; the message names the
    field, the expected and the actual value."""


class IncompatibleSpecError(InvalidConfigError):
    """Two KV cache specs cannot be merged or grouped together."""


class InsufficientMemoryError(PagedKVError, ValueError):
    """The available memory cannot hold what the model setting needs."""


class PoolExhaustedError(PagedKVError, RuntimeError):
    """The block pool has fewer free blocks than asked for.

    The manager never raises this to engines (``allocate_slots`` returns
    ``None`` instead); ``BlockPool.get_new_blocks`` raises it when called
    directly with too large a count.
    """


class InvariantViolation(PagedKVError, AssertionError):
    """``check_invariants()`` found a broken invariant; the message starts
    with the invariant's ID (e.g. ``POOL-3``) and carries a state dump."""


class InvalidRetentionError(InvalidArgumentError):
    """A retention directive, pin, unpin or quota is malformed or names
    blocks it cannot apply to (spec/retention.md); the message names the
    field. Nothing changes."""


class PinBudgetExceededError(PagedKVError, RuntimeError):
    """A pin would take more blocks than the pool's pin budget allows
    (RET-6). Refused as a whole: no block of it is pinned."""
