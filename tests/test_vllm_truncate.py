"""``truncate_computed_blocks`` (pagedkv.vllm, D-API-42): the rule on plain
lists, no vLLM needed. Groups: full attention (block 2), Mamba align
(block 4), a ring of 8 rows outside prefix caching."""

from __future__ import annotations

import pytest

from pagedkv.spec import FullAttentionSpec
from pagedkv.spec.attention_variants import CircularBufferSpec
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.vllm.truncate import VllmPreconditionError, truncated_groups

SPECS = (FullAttentionSpec(2, 1, 8, "float16"),
         MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align"),
         CircularBufferSpec(8, 1, 8, "float16"))
SIZES = (2, 4, 8)


def test_each_group_keeps_the_blocks_before_the_endpoint() -> None:
    hit: tuple[list[int], ...] = ([11, 12, 13], [0, 21], [])
    assert truncated_groups(hit, SPECS, SIZES, 4) == [[11, 12], [0], []]
    assert hit == ([11, 12, 13], [0, 21], [])  # the lookup result is not mutated


def test_a_short_mamba_hit_is_allowed_a_short_full_attention_hit_is_not() -> None:
    # A connector supplies the Mamba state at 4 tokens: the Mamba group may hold none.
    assert truncated_groups(([11, 12, 13], [], []), SPECS, SIZES, 4) == [[11, 12], [], []]
    with pytest.raises(VllmPreconditionError, match="group 0 holds 1 hit block"):
        truncated_groups(([11], [0, 21], []), SPECS, SIZES, 4)


@pytest.mark.parametrize("endpoint", [6, 3])
def test_an_endpoint_off_a_block_boundary_is_refused(endpoint: int) -> None:
    with pytest.raises(VllmPreconditionError, match="not a multiple"):
        truncated_groups(([11, 12, 13], [0, 21], []), SPECS, SIZES, endpoint)


def test_a_ring_with_hit_blocks_is_refused_and_the_error_is_both_kinds() -> None:
    with pytest.raises(VllmPreconditionError, match="group 2 is outside prefix caching") as caught:
        truncated_groups(([11, 12], [0], [31]), SPECS, SIZES, 4)
    # pagedkv's typed error, and what vLLM's own assert would raise.
    assert isinstance(caught.value, InvalidArgumentError) and isinstance(caught.value, AssertionError)
