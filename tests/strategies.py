"""Every configuration and argument the lockstep machines draw, in one place.

A new manager option is drawn here once (:func:`manager_options`) and every
machine exercises it; a new attention type joins :func:`group_spec`; a new
rule's arguments get a strategy next to the others below. The machines
themselves (``tests/test_differential*.py``) hold no strategy of their own
beyond what depends on the state they track.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st

from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MMFeature
from pagedkv.spec.attention_variants import CircularBufferSpec, RSWASpec, SlidingWindowMLASpec
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from pagedkv.spec.registry import manager_kind_for

__all__ = [
    "ALPHABET", "LOOKAHEAD", "DELAY_CACHING", "WHOLE_SEQUENCE", "OUTPUT_TOKENS", "EVICT_IDS",
    "BAD_TOKEN_COUNTS",
    "RESERVED_BLOCKS", "Setup", "manager_options", "group_spec", "hybrid_groups",
    "full_attention_setups", "hybrid_setups", "request_extras", "prompts", "workloads",
]

ALPHABET = st.integers(0, 2)
"""Token ids: a tiny alphabet, so full hits, partial hits and duplicate blocks happen."""

# -- arguments of the machines' rules -------------------------------------------------

LOOKAHEAD = st.integers(0, 3)
"""``num_lookahead_tokens`` of an allocation (speculative decoding)."""
DELAY_CACHING = st.integers(0, 4).map(lambda n: n == 0)
"""``delay_cache_blocks``: now and then (P/D: the KV arrives later)."""
WHOLE_SEQUENCE = st.integers(0, 3).map(lambda n: n == 0)
"""``full_sequence_must_fit`` of an admission."""
OUTPUT_TOKENS = st.lists(ALPHABET, min_size=1, max_size=3)
"""Tokens one model step emits (speculative decoding may emit several)."""
EVICT_IDS = st.lists(st.integers(0, 44), max_size=4)
"""``evict_blocks`` arguments, some outside the pool."""
BAD_TOKEN_COUNTS = st.integers(-2, 0)
"""``num_new_tokens`` values every implementation must refuse."""

RESERVED_BLOCKS = st.integers(0, 4).flatmap(lambda n: st.integers(0, 3) if n == 0 else st.just(0))
"""``allocate_slots(reserved_blocks=...)``: mostly none, sometimes a few (D-API-13)."""
WATERMARK_BLOCKS = st.integers(0, 4).flatmap(lambda n: st.integers(0, 3) if n == 0 else st.just(0))
"""``allocate_slots(watermark_blocks=...)``: mostly none, sometimes a few (D-API-48)."""


def headroom(few: st.SearchStrategy[int], num_free_blocks: int) -> st.SearchStrategy[int]:
    """``few``, or now and then any count up to the free blocks: a headroom
    at the pool's edge, where the step's gate and the whole request's gate
    (D-API-48) can disagree."""
    return st.integers(0, 5).flatmap(lambda n: st.integers(0, num_free_blocks) if n == 0 else few)
TAILS = st.lists(ALPHABET, max_size=12)
"""A new request's tokens after the shared prefix it starts with."""


@st.composite
def prompts(draw: st.DrawFn, prefixes: list[list[int]], max_model_len: int) -> list[int]:
    """A request's tokens: a cut of one shared prefix, then its own tail."""
    prefix = draw(st.sampled_from(prefixes), label="prefix")
    cut = draw(st.integers(0, len(prefix)), label="prefix tokens kept")
    return (prefix[:cut] + draw(TAILS, label="tail"))[: max_model_len - 1] or [0]


@st.composite
def workloads(draw: st.DrawFn, prefixes: list[list[int]], max_model_len: int) -> list[tuple[list[int], dict[str, Any]]]:
    """1-3 requests waiting at the start."""
    tokens = draw(st.lists(prompts(prefixes, max_model_len), min_size=1, max_size=3))
    return [(prompt, draw(request_extras(len(prompt)))) for prompt in tokens]


@st.composite
def request_extras(draw: st.DrawFn, num_tokens: int) -> dict[str, Any]:
    """Keyword arguments of ``make_request`` beyond the tokens: a LoRA
    adapter, a cache salt, a multimodal input, each now and then."""
    extra: dict[str, Any] = {}
    if draw(st.integers(0, 9)) == 0:
        extra["lora_name"] = draw(st.sampled_from(["adapter-a", "adapter-b"]))
    if draw(st.integers(0, 9)) == 0:
        extra["cache_salt"] = "salt"
    if draw(st.integers(0, 9)) == 0 and num_tokens >= 2:
        offset = draw(st.integers(0, num_tokens - 2))
        length = draw(st.integers(1, num_tokens - offset))
        extra["mm_features"] = (MMFeature(draw(st.sampled_from(["img0", "img1"])), offset, length),)
    return extra


# -- configurations -----------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One drawn configuration: what every implementation's manager is built from."""

    config: KVCacheConfig
    max_model_len: int
    options: dict[str, Any]
    """Keyword arguments of ``KVCacheManager`` (see :func:`manager_options`)."""
    prefixes: list[list[int]]
    """Shared prompt prefixes new requests start from."""
    workload: list[tuple[list[int], dict[str, Any]]]
    """Requests waiting when the machine starts (tokens, ``make_request``
    extras): whichever rules Hypothesis' swarm testing turns off for a run,
    there is work to admit."""
    encoder_tokens: int = 0
    """``num_encoder_tokens`` of every admission (cross-attention models)."""


@st.composite
def manager_options(draw: st.DrawFn, *, alignment: int, enable_caching: bool,
                    hash_fns: tuple[str, ...] = ("sha256", "xxh3_128", "sha256_cbor"),
                    sparse: bool = False) -> dict[str, Any]:
    """Every keyword option of ``KVCacheManager`` but the caching switch's
    consequences: draw a new option here and every machine covers it.
    ``alignment`` is the LCM of the groups' block sizes (retention intervals
    are multiples of it); ``sparse``: the model has a sliding-window or Mamba
    group, without which a positive retention interval is refused (D-CFG-12)."""
    retention = draw(st.sampled_from([None, None, 0, 1, 2] if sparse else [None, None, 0]))
    return dict(
        enable_caching=enable_caching,
        hash_fn=draw(st.sampled_from(hash_fns)),
        use_eagle=draw(st.booleans()),
        log_stats=draw(st.booleans()),
        enable_kv_cache_events=draw(st.booleans()),
        block_stored_events=draw(st.sampled_from(["per_call", "per_run"])),
        max_num_batched_tokens=draw(st.sampled_from([None, 2, 4, 8])),
        retention_interval=None if retention is None else retention * alignment,
        hash_seed=draw(st.sampled_from([None, None, "lockstep"])),
        num_hash_lookahead_tokens=draw(st.sampled_from([0, 0, 0, 1, 2])),
        num_prefill_lookahead=draw(st.sampled_from([0, 0, 0, 1, 2, 3])),
    )


@st.composite
def full_attention_setups(draw: st.DrawFn) -> Setup:
    """Full attention: one group with prefix caching, or 0-2 groups without."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    enable_caching = draw(st.booleans())
    num_groups = 1 if enable_caching else draw(st.integers(0, 2))
    groups = tuple(KVCacheGroupSpec((f"layer.{g}",), FullAttentionSpec(block_size, 1, 8, "float16"))
                   for g in range(num_groups))
    max_model_len = draw(st.integers(8, 64))
    prefixes = draw(st.lists(st.lists(ALPHABET, min_size=1, max_size=24), min_size=1, max_size=3))
    return Setup(
        config=KVCacheConfig(draw(st.integers(1, 40)), (), groups),
        max_model_len=max_model_len,
        options=draw(manager_options(alignment=block_size if groups else 1, enable_caching=enable_caching)),
        prefixes=prefixes,
        workload=draw(workloads(prefixes, max_model_len)),
    )


HYBRID_KINDS = ("full", "sliding_window", "chunked_local", "mamba")
"""Attention types a hybrid model mixes; ``cross_attention`` and ``sink`` join now and then."""


@st.composite
def group_spec(draw: st.DrawFn, kind: str) -> KVCacheSpec:
    """One group's spec of the given attention type."""
    block_size = draw(st.sampled_from([2, 4]))
    if kind == "full":
        return FullAttentionSpec(block_size, 1, 8, "float16")
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size, 1, 8, "float16", sliding_window=draw(st.integers(1, 9)),
                                 extra_retained_tokens=draw(st.sampled_from([0, 0, 0, 1, 3])))
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(block_size, 1, 8, "float16",
                                         attention_chunk_size=block_size * draw(st.integers(1, 3)))
    if kind == "mamba":
        # Prefill checkpoints (spec/mamba.md) need align mode and chunks of
        # two blocks or more; a Mamba block of 8 over hash blocks of 2 also
        # draws checkpoints inside a block (MCKPT-4).
        mode = draw(st.sampled_from(["all"] * 4 + ["align"] * 3 + ["none"]))
        checkpoints = mode == "align" and draw(st.booleans())
        return MambaSpec(draw(st.sampled_from([2, 4, 8])) if checkpoints else block_size,
                         shapes=((2,),), dtypes=("float16",), mamba_cache_mode=mode,
                         num_speculative_blocks=draw(st.integers(0, 2)),
                         num_prefill_checkpoint_blocks=int(checkpoints),
                         prefill_checkpoint_alignment=draw(st.sampled_from([None, 1, 2, 4]))
                         if checkpoints else None)
    if kind == "cross_attention":
        return CrossAttentionSpec(block_size, 1, 8, "float16")
    if kind == "bounded_replay":
        # A window outside prefix caching: it never hits nor caches (PFX-1).
        return SlidingWindowMLASpec(block_size, 1, 8, "float16", sliding_window=draw(st.integers(1, 9)),
                                    bounded_replay=True)
    if kind == "rswa":
        # Full attention that releases the blocks between prompt and decode window (RSWA-1).
        return RSWASpec(block_size, 1, 8, "float16", rswa_window=draw(st.integers(1, 9)))
    if kind == "ring":
        # One block per request outside prefix caching (RING-1); its size (3
        # among them) need not divide or be divided by any other block size.
        return CircularBufferSpec(draw(st.sampled_from([3, 4, 8])), 1, 8, "float16")
    assert kind == "sink", kind
    return SinkFullAttentionSpec(block_size, 1, 8, "float16", sink_len=block_size * draw(st.integers(1, 2)))


@st.composite
def hybrid_groups(draw: st.DrawFn) -> list[KVCacheSpec]:
    """1-4 types, 1-3 groups each, sometimes a cross-attention, sink, bounded-replay, ring or R-SWA group."""
    kinds = draw(st.lists(st.sampled_from(HYBRID_KINDS), min_size=1, max_size=4, unique=True))
    specs = [draw(group_spec(kind)) for kind in kinds for _ in range(draw(st.integers(1, 3)))]
    for extra in ("cross_attention", "sink", "bounded_replay", "ring", "rswa"):
        if draw(st.integers(0, 7)) == 0:
            specs.append(draw(group_spec(extra)))
    return draw(st.permutations(specs))


@st.composite
def hybrid_setups(draw: st.DrawFn) -> Setup:
    """Hybrid models, prefix caching on (and sometimes off); the pool gets
    room for the sink blocks on top of the drawn size."""
    specs = draw(hybrid_groups())
    # Draft-layer groups now and then (D-SWA-14): the EAGLE rule then applies
    # to them and their same-spec siblings only.
    marks = [draw(st.integers(0, 3)) == 0 for _ in specs]
    groups = tuple(KVCacheGroupSpec((f"layer.{index}",), spec, is_eagle_group=mark)
                   for index, (spec, mark) in enumerate(zip(specs, marks)))
    sinks = sum(spec.sink_len // spec.block_size for spec in specs
                if isinstance(spec, SinkFullAttentionSpec) and spec.sink_len)
    encoder = any(isinstance(spec, CrossAttentionSpec) for spec in specs)
    enable_caching = draw(st.integers(0, 5).map(bool))
    options = draw(manager_options(alignment=math.lcm(*(spec.block_size for spec in specs)),
                                   enable_caching=enable_caching, hash_fns=("sha256", "xxh3_128"),
                                   sparse=any(manager_kind_for(spec) in ("sliding_window", "mamba")
                                              for spec in specs)))
    max_model_len = draw(st.integers(16, 48))
    prefixes = draw(st.lists(st.lists(ALPHABET, min_size=8, max_size=32), min_size=1, max_size=2))
    return Setup(
        config=KVCacheConfig(draw(st.integers(16, 160)) + sinks, (), groups),
        max_model_len=max_model_len,
        options=options,
        prefixes=prefixes,
        workload=draw(workloads(prefixes, max_model_len)),
        encoder_tokens=draw(st.integers(1, 10)) if encoder else 0,
    )
