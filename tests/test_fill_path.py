"""The filling branch of the several-group decode step (``optimized/paths/fill_path.py``,
D-PERF-37) against the general path.

Two optimized managers are built alike; one keeps its decode step, the other
has it switched off, so every ``allocate_slots`` there takes the spec's
general path. Both are driven through the same random decode and prefill
steps (several tokens at once, fewer tokens appended than scheduled, delayed
caching, malformed counts, frees, a pool small enough to evict and refuse),
and after every step the results, the raised error types, the snapshots and
the kv-cache events must be equal. The configurations cover each branch of
the step: plain groups cached inline (full, sliding window, chunked local),
sliding windows with a cache mask or an EAGLE rule (cached by the
coordinator), Mamba in each mode with and without speculative blocks, a
ring group, caching off.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagedkv.optimized import KVCacheManager
from pagedkv.optimized.paths.decode_path import TAKE_GENERAL_PATH, DecodeStep
from pagedkv.spec import FullAttentionSpec, InvalidArgumentError, KVCacheConfig, KVCacheGroupSpec, Request
from pagedkv.spec.attention_variants import CircularBufferSpec
from pagedkv.spec.kv_cache_spec import ChunkedLocalAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.spec.mamba_spec import MambaSpec
from tests.twins import drive_twins

BLOCK = 4


def _spec(kind: str, block_size: int = BLOCK, window: int = 6, chunk: int = 8) -> KVCacheSpec:
    if kind == "full":
        return FullAttentionSpec(block_size, 1, 1, "float16")
    if kind == "sliding":
        return SlidingWindowSpec(block_size, 1, 1, "float16", sliding_window=window)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(block_size, 1, 1, "float16", attention_chunk_size=chunk)
    if kind == "ring":
        return CircularBufferSpec(block_size, 1, 1, "float16")
    mode, _, spec_blocks = kind.partition(":")
    return MambaSpec(block_size, shapes=((2,),), dtypes=("float16",), mamba_cache_mode=mode[6:],
                     num_speculative_blocks=int(spec_blocks or 0))


def _twins(kinds: tuple[str, ...], caching: bool, num_blocks: int, events: bool = True,
           **options: object) -> tuple[KVCacheManager, KVCacheManager]:
    config = KVCacheConfig(num_blocks, (), tuple(
        KVCacheGroupSpec((f"layer.{index}",), _spec(kind)) for index, kind in enumerate(kinds)))
    fast, general = (KVCacheManager(config, 96, enable_caching=caching, enable_kv_cache_events=events,
                                    log_stats=True, **options)  # type: ignore[arg-type]
                     for _ in range(2))
    assert fast.coordinator.decode_step is not None, kinds
    general.coordinator.decode_step = None
    return fast, general


CONFIGS = [
    (("full",), {}),  # one full-attention group: the same step since the single-group copy went
    (("sliding", "sliding", "full"), {}),
    (("full", "chunked"), {}),
    (("sliding",), {}),
    (("sliding", "full"), {"retention_interval": 8}),  # a cache mask: cached by the coordinator
    (("sliding", "full"), {"use_eagle": True}),
    (("full", "mamba-align"), {}),
    (("full", "mamba-align:1"), {}),
    (("full", "mamba-all"), {}),
    (("sliding", "mamba-none"), {}),
    (("full", "ring"), {}),
]


@pytest.mark.parametrize(("kinds", "options"), CONFIGS, ids=[" ".join(kinds) + (f" {options}" if options else "")
                                                           for kinds, options in CONFIGS])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_filling_step_equals_the_general_path(kinds: tuple[str, ...], options: dict[str, object],
                                              caching: bool, seed: int) -> None:
    # Events on for two seeds (the request's snapshot), off for one (pagedkv's own
    # request read in place, D-PERF-50).
    rng = random.Random(repr((kinds, options, caching, seed)))
    fast, general = _twins(kinds, caching, num_blocks=rng.choice([14, 24, 60]), events=seed != 2, **options)
    changed = drive_twins(fast, general, rng, steps=250, vocab=3, max_prompt=14, num_new=(1, 1, 1, 2, 5),
                          fast_step=lambda manager, r, n, delay: manager.allocate_slots(r, n, delay_cache_blocks=delay))
    assert changed >= 20, changed  # the filling branch ran, not only the no-op one


def _at_a_block_boundary() -> tuple[KVCacheManager, KVCacheManager, list[Request], DecodeStep]:
    """Twins (sliding window + full, block 4) each holding request "a" with 4
    tokens computed and a fifth appended: its next step needs a new block."""
    fast, general = _twins(("sliding", "full"), True, num_blocks=40)
    pair = [manager.make_request("a", [1, 2, 3, 4]) for manager in (fast, general)]
    for manager, r in zip((fast, general), pair):
        assert manager.allocate_slots(r, 4) is not None
        r.num_computed_tokens = 4
        r.append_output_token_ids(5)
    decode_step = fast.coordinator.decode_step
    assert decode_step is not None
    return fast, general, pair, decode_step


def test_filling_step_takes_the_step_the_probe_declines() -> None:
    """A step that needs a block in a hybrid is settled by the decode step
    itself (not handed to the general path), with the general path's answer."""
    fast, general, pair, decode_step = _at_a_block_boundary()
    settled = decode_step(pair[0], 1, False)
    assert settled is not TAKE_GENERAL_PATH and settled is not None
    expected = general.allocate_slots(pair[1], 1)
    assert expected is not None
    assert settled.get_block_ids() == expected.get_block_ids() and any(expected.get_block_ids())
    assert fast.snapshot() == general.snapshot()


def test_filling_step_takes_an_adapters_snapshot_of_its_request_class() -> None:
    """An adapter registers how to snapshot its engine's request class
    (``request_facts_readers``, as pagedkv.vllm does for vLLM's Request): the filling
    step takes the facts that way, so a class without every RequestView
    attribute still fills, as the adapter's general path would serve it."""
    from pagedkv.spec.request import RequestFacts

    class EngineRequest:
        """Has what the decode step reads, not lora_id and the rest of RequestView."""

        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            if name in ("lora_id", "lora_name", "cache_salt"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    def snapshot(request: EngineRequest) -> RequestFacts:
        facts = RequestFacts.capture(request.inner)  # type: ignore[arg-type]
        return facts

    fast, general, pair, decode_step = _at_a_block_boundary()
    engine_request: Any = EngineRequest(pair[0])
    with pytest.raises(InvalidArgumentError):  # unregistered: the general path's snapshot refuses it
        decode_step(engine_request, 1, False)
    assert fast.snapshot() == general.snapshot()  # nothing changed
    fast.coordinator.request_facts_readers[EngineRequest] = snapshot
    settled = decode_step(engine_request, 1, False)
    expected = general.allocate_slots(pair[1], 1)
    assert settled is not None and settled is not TAKE_GENERAL_PATH and expected is not None
    assert settled.get_block_ids() == expected.get_block_ids()
    assert fast.snapshot() == general.snapshot()
