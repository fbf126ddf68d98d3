"""``pagedkv simulate``'s requests and workload analysis: the synthetic tokens,
the memoised hashes (equal to the manager's own), the ideal hit rate and the
reuse distances (against brute-force definitions)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv.simulate.analysis import analyze
from pagedkv.simulate.requests import OUTPUT_TOKEN, PrefixHasher, SimRequest, TokenSource
from pagedkv.simulate.workload import TraceRequest, Workload, load_workload
from pagedkv.trace import standard_kv_cache_config

DATA = Path(__file__).parent / "data"
CONVERSATION = str(DATA / "mooncake_conversation_excerpt.jsonl")
SYNTHETIC = str(DATA / "mooncake_synthetic_excerpt.jsonl")


def _tokens(source: TokenSource, ids: tuple[int, ...], length: int) -> list[int]:
    out: list[int] = []
    for block_id in ids:
        out += source.block(block_id)
    return out[:length]


@pytest.mark.parametrize("hash_fn", ["xxh3_128", "sha256"])
@pytest.mark.parametrize(("trace_block", "hash_block"), [(32, 32), (32, 8), (8, 32), (12, 8)])
def test_memoised_hashes_equal_the_managers(hash_fn: str, trace_block: int, hash_block: int) -> None:
    # Prompts sharing prefixes of ids, some ending inside a trace block: every
    # prompt's hashes (from the memo or the hasher) equal make_request's.
    manager = pagedkv.KVCacheManager(standard_kv_cache_config(64, hash_block), 4096,
                                     hash_fn=hash_fn, hash_seed="7")
    source = TokenSource(trace_block, seed=3)
    hasher = PrefixHasher(hash_fn, hash_block, trace_block, "7")
    prompts = [((1, 2, 3, 4), 4 * trace_block), ((1, 2, 3, 9), 4 * trace_block - 5),
               ((1, 2, 5), 3 * trace_block), ((1, 2, 3, 4, 6), 5 * trace_block - 1), ((1, 2), 7)]
    for number, (ids, length) in enumerate(prompts * 2):
        request = SimRequest(f"r{number}", ids, length, source, hasher)
        expected = manager.make_request(f"m{number}", _tokens(source, ids, length))
        assert request.block_hashes == expected.block_hashes
        assert list(request.all_token_ids[:]) == expected.all_token_ids
        for _ in range(2 * hash_block + 1):  # outputs hash the blocks they complete
            request.append_output_token_ids(1)
            expected.append_output_token_ids(OUTPUT_TOKEN)
        assert request.block_hashes == expected.block_hashes
        assert request.num_tokens == expected.num_tokens
    assert hasher.memoised > 0 and hasher.hashed > 0


@settings(max_examples=50)
@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 3))
def test_lazy_tokens_slice_like_a_list(start: int, stop: int, outputs: int) -> None:
    source = TokenSource(16, seed=1)
    hasher = PrefixHasher("xxh3_128", 16, 16)
    request = SimRequest("r", (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23),
                         290, source, hasher)
    request.append_output_token_ids(outputs)
    materialised = _tokens(source, tuple(request.block_ids), 290) + [OUTPUT_TOKEN] * outputs
    assert request.all_token_ids[start:stop] == materialised[start:stop]
    assert len(request.all_token_ids) == len(materialised)
    if start < len(materialised):
        assert request.all_token_ids[start] == materialised[start]
        assert request.all_token_ids[-1 - start] == materialised[-1 - start]
    assert request.all_token_ids[start:stop:3] == materialised[start:stop:3]


def test_token_source_distinguishes_ids_and_is_deterministic() -> None:
    a, b = TokenSource(512, seed=0), TokenSource(512, seed=0)
    assert a.block(17) == b.block(17) and len(a.block(17)) == 512
    assert a.block(17) != a.block(18) and a.block(0)[:3] != a.block(1 << 40)[:3]
    assert TokenSource(512, seed=1).block(17) != a.block(17)
    with pytest.raises(ValueError, match="block_tokens"):
        TokenSource(3)


def _ideal_by_definition(workload: Workload, h: int) -> tuple[int, int]:
    """Hit tokens and blocks of an unbounded cache, from the token lists."""
    source = TokenSource(workload.block_tokens)
    seen: set[tuple[int, ...]] = set()
    tokens_hit = blocks_hit = 0
    for request in workload.requests:
        tokens = tuple(_tokens(source, request.block_ids, request.input_length))
        full = len(tokens) // h
        hit = 0
        while hit < (len(tokens) - 1) // h and tokens[:(hit + 1) * h] in seen:
            hit += 1
        tokens_hit += hit * h
        blocks_hit += hit
        seen.update(tokens[:(i + 1) * h] for i in range(full))
    return tokens_hit, blocks_hit


def _stack_distances(workload: Workload, h: int) -> list[int]:
    """LRU stack distances of the reusable prefix blocks, by brute force."""
    source = TokenSource(workload.block_tokens)
    history: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    out: list[int] = []
    for request in workload.requests:
        tokens = tuple(_tokens(source, request.block_ids, request.input_length))
        blocks = [tokens[:(i + 1) * h] for i in range(len(tokens) // h)]
        hit = 0
        while hit < (len(tokens) - 1) // h and blocks[hit] in seen:
            hit += 1
        for index, block in enumerate(blocks):
            if block in seen and index < hit:
                last = len(history) - 1 - history[::-1].index(block)
                out.append(len(set(history[last + 1:])) + 1)
            history.append(block)
        seen.update(blocks)
    return sorted(out)


@pytest.mark.parametrize("h", [8, 16, 24])
def test_ideal_and_reuse_distances_match_their_definitions(h: int) -> None:
    requests = [TraceRequest(float(i), length, 1, ids) for i, (ids, length) in enumerate([
        ((1, 2, 3), 40), ((1, 2, 4), 48), ((1, 2, 3), 45), ((5,), 10), ((1, 2, 4, 6), 60),
        ((1, 2, 3), 48), ((5, 7), 31), ((1,), 16)])]
    workload = Workload("tiny", 16, tuple(requests))
    analysis = analyze(workload, h)
    assert (analysis.ideal_hit_tokens, analysis.ideal_hit_blocks) == _ideal_by_definition(workload, h)
    assert analysis.reuse_distances == _stack_distances(workload, h)


def test_ideal_of_the_excerpts_matches_the_definition() -> None:
    for path in (CONVERSATION, SYNTHETIC):
        workload = load_workload(path).limited(60)
        analysis = analyze(workload, 512, reuse=False)
        assert (analysis.ideal_hit_tokens, analysis.ideal_hit_blocks) == _ideal_by_definition(workload, 512)
        assert analysis.ideal_hit_tokens > 0
