"""The lockstep machine over hybrid models.

Random mixes of 1-4 attention types from {full, sliding window (several
windows), chunked local, Mamba (all / align modes, speculative blocks)},
1-3 groups per type with mixed block sizes, EAGLE on and off, plus
cross-attention (encoder-decoder) and attention-sink groups now and then.
Every rule of :class:`tests.test_differential.Lockstep` runs against both
implementations with full-state comparison after every step.
"""

from __future__ import annotations

import math
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from tests.test_differential import ALPHABET, Lockstep

BLOCK_SIZES = st.sampled_from([2, 4])


@st.composite
def group_spec(draw: st.DrawFn, kind: str) -> KVCacheSpec:
    """One group's spec of the given attention type."""
    block_size = draw(BLOCK_SIZES)
    if kind == "full":
        return FullAttentionSpec(block_size, 1, 8, "float16")
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size, 1, 8, "float16", sliding_window=draw(st.integers(1, 9)))
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(block_size, 1, 8, "float16",
                                         attention_chunk_size=block_size * draw(st.integers(1, 3)))
    if kind == "mamba":
        return MambaSpec(block_size, shapes=((2,),), dtypes=("float16",),
                         mamba_cache_mode=draw(st.sampled_from(["all"] * 4 + ["align"] * 3 + ["none"])),
                         num_speculative_blocks=draw(st.integers(0, 2)))
    if kind == "cross_attention":
        return CrossAttentionSpec(block_size, 1, 8, "float16")
    return SinkFullAttentionSpec(block_size, 1, 8, "float16", sink_len=block_size * draw(st.integers(1, 2)))


@st.composite
def hybrid_groups(draw: st.DrawFn) -> list[KVCacheSpec]:
    """1-4 types, 1-3 groups each, sometimes a cross-attention or sink group."""
    kinds = draw(st.lists(st.sampled_from(["full", "sliding_window", "chunked_local", "mamba"]),
                          min_size=1, max_size=4, unique=True))
    specs = [draw(group_spec(kind)) for kind in kinds for _ in range(draw(st.integers(1, 3)))]
    for extra in ("cross_attention", "sink"):
        if draw(st.integers(0, 7)) == 0:
            specs.append(draw(group_spec(extra)))
    return draw(st.permutations(specs))


class HybridLockstepMachine(Lockstep):
    """Hybrid configurations, prefix caching on (and sometimes off)."""

    @initialize(
        specs=hybrid_groups(),
        num_blocks=st.integers(16, 160),
        max_model_len=st.integers(16, 48),
        enable_caching=st.integers(0, 5).map(bool),
        events=st.booleans(),
        log_stats=st.booleans(),
        hash_fn=st.sampled_from(["sha256", "xxh3_128"]),
        use_eagle=st.booleans(),
        encoder_tokens=st.integers(1, 10),
        max_num_batched_tokens=st.sampled_from([None, 2, 4, 8]),
        retention=st.sampled_from([None, None, 0, 1, 2]),
        prefixes=st.lists(st.lists(ALPHABET, min_size=8, max_size=32), min_size=1, max_size=2),
    )
    def setup(self, specs: list[KVCacheSpec], num_blocks: int, max_model_len: int, enable_caching: bool,
              events: bool, log_stats: bool, hash_fn: str, use_eagle: bool, encoder_tokens: int,
              max_num_batched_tokens: int | None, retention: int | None,
              prefixes: list[list[int]]) -> None:
        groups = tuple(KVCacheGroupSpec((f"layer.{index}",), spec) for index, spec in enumerate(specs))
        if any(isinstance(spec, CrossAttentionSpec) for spec in specs):
            self.encoder_tokens = encoder_tokens
        alignment = math.lcm(*(spec.block_size for spec in specs))
        sinks = sum(spec.sink_len // spec.block_size for spec in specs
                    if isinstance(spec, SinkFullAttentionSpec) and spec.sink_len)
        kwargs: dict[str, Any] = dict(enable_caching=enable_caching, hash_fn=hash_fn, use_eagle=use_eagle,
                                      log_stats=log_stats, enable_kv_cache_events=events,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      retention_interval=None if retention is None else retention * alignment)
        self.build(KVCacheConfig(num_blocks + sinks, (), groups), max_model_len, prefixes, **kwargs)


HybridLockstepMachine.TestCase.settings = settings(
    settings(), stateful_step_count=60, max_examples=settings().max_examples * 10)
test_hybrid_lockstep = HybridLockstepMachine.TestCase
