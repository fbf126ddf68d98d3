"""``truncate_computed_blocks``: a lookup result cut at an earlier endpoint
(spec/operations.md D.3, D-API-42).

A KV connector may supply the final Mamba state past the local hit, so the
scheduler cuts each group's hit blocks at an aligned endpoint ``n`` before
adopting them: ``n / b(g)`` blocks per group. The endpoint must be a whole
number of every prefix-cacheable group's blocks, and a group other than
Mamba must already hold that many (a Mamba group may hold fewer: the
connector's state replaces its short hit). A group outside prefix caching
(a ring, a bounded-replay window) never holds hit blocks and stays empty.
Pure slicing: no reference count changes and the argument is not mutated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.spec.attention_variants import prefix_cacheable
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = ["VllmPreconditionError", "truncated_groups"]


class VllmPreconditionError(InvalidArgumentError, AssertionError):
    """A caller precondition vLLM 0.33's manager asserts. pagedkv raises its
    typed error, which is also an ``AssertionError`` so that code written
    against vLLM sees what it expects (D-API-42)."""


def truncated_groups(groups: Sequence[Sequence[Any]], specs: Sequence[Any], block_sizes: Sequence[int],
                     num_computed_tokens: int) -> list[list[Any]]:
    """Each group's first ``num_computed_tokens / b(g)`` hit blocks.

    Raises:
        VllmPreconditionError: a group outside prefix caching holds blocks, the
            endpoint is not a multiple of a prefix-cacheable group's block
            size, or a non-Mamba group holds fewer blocks than it needs.
    """
    if type(num_computed_tokens) is not int or num_computed_tokens < 0:
        raise VllmPreconditionError(
            f"num_computed_tokens must be an int >= 0, got {num_computed_tokens!r}")
    truncated: list[list[Any]] = []
    for group_id, (blocks, spec, block_size) in enumerate(zip(groups, specs, block_sizes, strict=True)):
        if not prefix_cacheable(spec):
            if blocks:
                raise VllmPreconditionError(
                    f"blocks: group {group_id} is outside prefix caching and holds no hit, got "
                    f"{len(blocks)} block(s)")
            truncated.append([])
            continue
        if num_computed_tokens % block_size:
            raise VllmPreconditionError(
                f"num_computed_tokens: {num_computed_tokens} is not a multiple of group {group_id}'s "
                f"block size {block_size}")
        count = num_computed_tokens // block_size
        if count > len(blocks) and not isinstance(spec, MambaSpec):
            raise VllmPreconditionError(
                f"num_computed_tokens: group {group_id} holds {len(blocks)} hit block(s), "
                f"{count} needed for {num_computed_tokens} tokens")
        truncated.append(list(blocks[:count]))
    return truncated
