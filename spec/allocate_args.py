"""The checks of ``allocate_slots``'s step 1 (spec/operations.md) that do
not depend on how an implementation represents blocks, written once for
both (as :mod:`pagedkv.spec.manager_args` does for the constructor).

Each implementation's ``validation.allocate_args`` calls these in the
spec's order and adds the checks that read its own tables (1c, 1f, 1h, 1i).
Every function raises a typed error naming the parameter, or returns; none
changes anything. The optimized manager calls them on every general
``allocate_slots``, so the common case (every value well formed) runs a
single flat loop and the error messages are built only on failure.
"""

from __future__ import annotations

from pagedkv.spec.errors import ExceedsMaxModelLenError, InvalidArgumentError, InvalidTokenCountError
from pagedkv.spec.request import RequestView

__all__ = ["count", "check_counts", "check_hit_allowed", "check_max_model_len"]

_COUNT_NAMES = ("num_new_computed_tokens", "num_lookahead_tokens", "num_external_computed_tokens",
                "num_encoder_tokens", "reserved_blocks", "watermark_blocks", "num_in_flight_tokens",
                "request.num_computed_tokens")
"""The counts of check 1b, in the order they are checked."""


def count(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int ``>= minimum`` (a bool is not an int here).

    Raises:
        InvalidTokenCountError: it is not.
    """
    if type(value) is not int or value < minimum:
        raise InvalidTokenCountError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_counts(request: RequestView, known_request: bool, num_new_tokens: object,
                 num_new_computed_tokens: object, num_lookahead_tokens: object,
                 num_external_computed_tokens: object, num_encoder_tokens: object,
                 reserved_blocks: object, num_in_flight_tokens: object,
                 watermark_blocks: object = 0) -> None:
    """Checks 1a, 1b, 1b′ and 1b″, in that order: every count an int of its
    range (``num_new_tokens >= 0`` only when the call adopts computed tokens,
    D-API-12), ``request.num_tokens >= 1``, and no computed token on a
    request the manager does not know (a freed or preempted request handed
    back without the reset, D-API-21; a known one may have more computed
    tokens than ``num_tokens``, D-API-26). Reads ``request.num_computed_tokens``
    and ``request.num_tokens`` once each. Cost: O(1).

    Raises:
        InvalidTokenCountError: 1a, 1b, 1b′.
        InvalidArgumentError: 1b″.
    """
    adopting = ((type(num_new_computed_tokens) is int and num_new_computed_tokens > 0)
                or (type(num_external_computed_tokens) is int and num_external_computed_tokens > 0))
    if type(num_new_tokens) is not int or num_new_tokens < (0 if adopting else 1):
        raise InvalidTokenCountError(
            f"num_new_tokens must be an int >= 1 (>= 0 when computed tokens are adopted), "
            f"got {num_new_tokens!r}")
    computed = request.num_computed_tokens
    values = (num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
              num_encoder_tokens, reserved_blocks, watermark_blocks, num_in_flight_tokens, computed)
    for value in values:
        if type(value) is not int or value < 0:
            for name, named in zip(_COUNT_NAMES, values):
                count(name, named, 0)
    num_tokens = request.num_tokens
    if type(num_tokens) is not int or num_tokens < 1:
        raise InvalidTokenCountError(f"request.num_tokens must be an int >= 1, got {num_tokens!r}")
    if computed and not known_request:
        raise InvalidArgumentError(
            f"request {request.request_id!r} holds no blocks, so its num_computed_tokens must be 0, "
            f"got {computed} (reset it on free or preemption; a prefix hit goes in "
            f"num_new_computed_tokens) (D-API-21)")


def check_hit_allowed(request_id: str, known_request: bool, enable_caching: bool, num_groups: int,
                      num_new_computed_tokens: int, has_hits: bool) -> None:
    """Checks 1d, 1e and 1g: a prefix hit (``num_new_computed_tokens > 0``
    or any hit block) only for a request the manager does not know yet,
    with caching on, in a model with at least one group. With zero groups
    check 1f has nothing to compare, so running 1g before it raises what the
    spec's order raises. Cost: O(1).

    Raises:
        InvalidArgumentError: the hit is not allowed.
    """
    if not (num_new_computed_tokens or has_hits):
        return
    if known_request:
        raise InvalidArgumentError(
            f"request {request_id!r} already holds blocks: it cannot take new prefix hits "
            f"(new_computed_blocks, num_new_computed_tokens)")
    if not enable_caching:
        raise InvalidArgumentError("prefix caching is disabled: no computed blocks can be passed")
    if num_groups == 0 and num_new_computed_tokens:
        raise InvalidArgumentError("a model without KV cache groups has no computed blocks")


def check_max_model_len(request_id: str, num_main_tokens: int, max_model_len: int) -> None:
    """Check 1j: the request's tokens of the main model after this call
    (``request.num_computed_tokens + num_new_computed_tokens +
    num_external_computed_tokens + num_new_tokens``) fit ``max_model_len``.
    Cost: O(1).

    Raises:
        ExceedsMaxModelLenError: they do not.
    """
    if num_main_tokens > max_model_len:
        raise ExceedsMaxModelLenError(
            f"request {request_id!r} would hold {num_main_tokens} tokens, "
            f"more than max_model_len={max_model_len}")
