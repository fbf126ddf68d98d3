"""The seeds' worked examples for the other attention types and hybrids,
one suite over every implementation (spec/examples.md §1-3, §6-8)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pagedkv.reference import rules
from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec

N = 0  # the null block


def make(impl: ModuleType, *specs: KVCacheSpec, num_blocks: int = 40, **kwargs: Any) -> Any:
    groups = tuple(KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs))
    return impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), 256, **kwargs)


def run(manager: Any, request: Any, num_tokens: int, **kwargs: Any) -> Any:
    """Allocate and compute ``num_tokens`` more tokens of ``request``."""
    blocks = manager.allocate_slots(request, num_tokens, **kwargs)
    assert blocks is not None
    request.num_computed_tokens += num_tokens
    return blocks


def test_skipped_token_rules() -> None:
    assert rules.sliding_window_skipped_tokens(7, 4) == 4
    assert [rules.chunked_local_skipped_tokens(n, 8) for n in (13, 8, 7)] == [8, 8, 0]


def test_sliding_window_releases_blocks_outside_the_window(impl: ModuleType) -> None:
    manager = make(impl, SlidingWindowSpec(2, 1, 8, "float16", sliding_window=4))
    request = manager.make_request("a", list(range(7)))
    run(manager, request, 7)
    assert manager.get_block_ids("a") == ([1, 2, 3, 4],)
    request.append_output_token_ids(7)
    run(manager, request, 1)  # 7 computed: tokens 0-3 are out of the window
    assert manager.get_block_ids("a") == ([N, N, 3, 4],)
    # The released blocks were cached (full): they wait at the back, tail first.
    assert manager.snapshot().pool.free_queue[-2:] == (2, 1)


def test_chunked_local_releases_blocks_before_the_chunk(impl: ModuleType) -> None:
    manager = make(impl, ChunkedLocalAttentionSpec(4, 1, 8, "float16", attention_chunk_size=8))
    request = manager.make_request("a", list(range(13)))
    run(manager, request, 13)
    request.append_output_token_ids(13)
    run(manager, request, 1)
    assert manager.get_block_ids("a") == ([N, N, 3, 4],)


def test_chunked_local_hits(impl: ModuleType) -> None:
    manager = make(impl, ChunkedLocalAttentionSpec(4, 1, 8, "float16", attention_chunk_size=8))
    first = manager.make_request("a", list(range(16)))
    run(manager, first, 16)
    held = manager.get_block_ids("a")[0]
    # Max length 15: tokens 0-7 lie before the chunk, block 2 (tokens 8-11) is cached.
    hit, length = manager.get_computed_blocks(manager.make_request("b", list(range(16))))
    assert (hit.get_block_ids(), length) == (([N, N, held[2]],), 12)
    # Max length 16: every token lies before the next token's chunk: all null, nothing looked up.
    hit, length = manager.get_computed_blocks(manager.make_request("c", [9] * 17))
    assert (hit.get_block_ids(), length) == (([N, N, N, N],), 16)


def test_sliding_window_hit_pads_with_null_blocks(impl: ModuleType) -> None:
    manager = make(impl, SlidingWindowSpec(4, 1, 8, "float16", sliding_window=8))
    first = manager.make_request("a", list(range(17)))
    run(manager, first, 17)
    held = manager.get_block_ids("a")[0]
    hit, length = manager.get_computed_blocks(manager.make_request("b", list(range(17))))
    # Window 8, block 4: a hit needs the 2 blocks before its end; earlier ones are null.
    assert (hit.get_block_ids(), length) == (([N, N, held[2], held[3]],), 16)


def test_full_plus_sliding_window_hybrid_hit(impl: ModuleType) -> None:
    manager = make(impl, FullAttentionSpec(4, 1, 8, "float16"),
                   SlidingWindowSpec(4, 1, 8, "float16", sliding_window=5))
    first = manager.make_request("a", list(range(17)))
    run(manager, first, 17)
    full, window = manager.get_block_ids("a")
    hit, length = manager.get_computed_blocks(manager.make_request("b", list(range(17))))
    assert length == 16
    assert hit.get_block_ids() == (full[:4], [N, N, N, window[3]])
    # Evicting the window group's last block shortens the common hit for both groups.
    manager.evict_blocks([window[3]])
    hit, length = manager.get_computed_blocks(manager.make_request("c", list(range(17))))
    assert length == 12 and hit.get_block_ids() == (full[:3], [N, N, window[2]])


def test_mamba_align_with_a_speculative_block(impl: ModuleType) -> None:
    manager = make(impl, MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align",
                                   num_speculative_blocks=1), num_blocks=10)
    request = manager.make_request("a", list(range(40)))
    run(manager, request, 8)
    assert manager.get_block_ids("a") == ([N, 1, 2],)
    run(manager, request, 8)
    assert manager.get_block_ids("a") == ([N, 1, N, 2, 3],)
    run(manager, request, 8)
    assert manager.get_block_ids("a") == ([N, N, N, 2, N, 3, 4],)


def test_mamba_state_cached_this_step_is_not_hit_until_the_next_step(impl: ModuleType) -> None:
    manager = make(impl, MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="all"))
    first = manager.make_request("a", list(range(9)))
    run(manager, first, 9)
    second = manager.make_request("b", list(range(9)))
    hit, length = manager.get_computed_blocks(second)
    assert length == 8
    assert manager.allocate_slots(second, 1, length, hit) is None  # same step: refused
    manager.new_step_starts()
    assert manager.allocate_slots(second, 1, length, hit) is not None


def test_cross_attention_blocks_follow_encoder_tokens_and_never_hit(impl: ModuleType) -> None:
    manager = make(impl, FullAttentionSpec(4, 1, 8, "float16"), CrossAttentionSpec(4, 1, 8, "float16"))
    first = manager.make_request("a", list(range(9)))
    run(manager, first, 9, num_encoder_tokens=10)
    decoder, encoder = manager.get_block_ids("a")
    assert (len(decoder), len(encoder)) == (3, 3)
    assert all(manager.snapshot().pool.block_hashes[block] is None for block in encoder)
    hit, length = manager.get_computed_blocks(manager.make_request("b", list(range(9))))
    assert length == 0 and hit.get_block_ids() == ([], [])


def test_sink_blocks_are_held_for_good(impl: ModuleType) -> None:
    manager = make(impl, SinkFullAttentionSpec(4, 1, 8, "float16", sink_len=8), num_blocks=10)
    state = manager.snapshot().pool
    assert state.free_queue[:2] == (3, 4) and state.ref_counts[1:3] == (1, 1)
    request = manager.make_request("a", list(range(5)))
    run(manager, request, 5)
    assert manager.get_block_ids("a") == ([3, 4],)
    manager.free(request)
    assert manager.reset_prefix_cache()  # sink blocks do not count as "in use"
    assert manager.snapshot().pool.ref_counts[1:3] == (1, 1)


def test_mixed_block_sizes_align_hits_to_the_lcm(impl: ModuleType) -> None:
    manager = make(impl, FullAttentionSpec(2, 1, 8, "float16"), FullAttentionSpec(4, 1, 8, "float16"))
    first = manager.make_request("a", list(range(11)))
    run(manager, first, 11)
    small, large = manager.get_block_ids("a")
    hit, length = manager.get_computed_blocks(manager.make_request("b", list(range(11))))
    # Alignment lcm(2, 4) = 4: the hit is 8 tokens, not 10.
    assert length == 8 and hit.get_block_ids() == (small[:4], large[:2])


def test_admission_cap_lets_a_long_sliding_window_request_in(impl: ModuleType) -> None:
    """spec/managers.md §8: admitting by the whole sequence needs the cap,
    or a long sliding-window request could never fit a pool sized with
    recycling in mind."""
    spec = SlidingWindowSpec(2, 1, 8, "float16", sliding_window=4)
    uncapped = make(impl, spec, num_blocks=12)  # max_num_batched_tokens defaults to max_model_len
    request = uncapped.make_request("a", list(range(40)))
    assert uncapped.allocate_slots(request, 4, full_sequence_must_fit=True) is None  # 20 blocks > 11
    assert uncapped.snapshot().requests == ()

    capped = make(impl, spec, num_blocks=12, max_num_batched_tokens=4)
    cap = spec.max_admission_blocks_per_request(4, 256)
    assert cap == 5
    request = capped.make_request("a", list(range(40)))
    while request.num_computed_tokens < request.num_tokens:
        assert capped.allocate_slots(request, 4, full_sequence_must_fit=True) is not None
        request.num_computed_tokens += 4
        held = [block for block in capped.get_block_ids("a")[0] if block != N]
        assert len(held) <= cap  # SWA-1: the bound the cap relies on
