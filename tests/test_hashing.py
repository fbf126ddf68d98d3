"""HASH-1: a request's block hashes are the chained hash of its full blocks,
for every implementation's hasher and every hash function."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from pagedkv.spec import (
    FullAttentionSpec,
    InvalidArgumentError,
    InvalidConfigError,
    KVCacheConfig,
    KVCacheGroupSpec,
    MMFeature,
)
from pagedkv.spec.hashing import block_extra_keys, hash_block_tokens, need_extra_keys, normalize_hash_fn, seed_hash
from pagedkv.spec.request import pack_token_ids
from pagedkv.spec.types import BlockHash
from tests.implementations import IMPLEMENTATIONS


def expected_hashes(request: Any, hash_fn: str, block_size: int) -> list[bytes]:
    """HASH-1 written out: block by block from the seed, extra keys rescanned."""
    name = normalize_hash_fn(hash_fn)
    parent = seed_hash(name)
    hashes: list[bytes] = []
    for index in range(request.num_tokens // block_size):
        start, end = index * block_size, (index + 1) * block_size
        extra = block_extra_keys(request, start, end, 0)[0] if need_extra_keys(request) else None
        parent = hash_block_tokens(name, parent, request.all_token_ids[start:end], extra)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@given(
    hash_fn=st.sampled_from(["sha256", "sha256_cbor", "xxh3_128", "xxhash"]),
    block_size=st.sampled_from([1, 3, 16]),
    prompt=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=70),
    appends=st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=20), max_size=4),
    lora=st.sampled_from([None, "adapter"]),
    salt=st.sampled_from([None, "salt"]),
    image=st.booleans(),
)
def test_block_hashes_follow_the_chain(name: str, hash_fn: str, block_size: int, prompt: list[int],
                                       appends: list[list[int]], lora: str | None, salt: str | None,
                                       image: bool) -> None:
    impl: ModuleType = IMPLEMENTATIONS[name]
    config = KVCacheConfig(4, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(block_size, 1, 8, "float16")),))
    manager = impl.KVCacheManager(config, 1024, hash_fn=hash_fn)
    features = (MMFeature("img", len(prompt) // 3, max(1, len(prompt) // 3)),) if image else ()
    request = manager.make_request("r", prompt, lora_name=lora, cache_salt=salt, mm_features=features)
    assert request.block_hashes == expected_hashes(request, hash_fn, block_size)
    for tokens in appends:
        request.append_output_token_ids(tokens)
        assert request.block_hashes == expected_hashes(request, hash_fn, block_size)


def test_unknown_hash_function_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="hash_fn"):
        normalize_hash_fn("md5")


def test_negative_tokens_are_refused() -> None:
    config = KVCacheConfig(4, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(4, 1, 8, "float16")),))
    for impl in IMPLEMENTATIONS.values():
        manager = impl.KVCacheManager(config, 64)
        with pytest.raises(InvalidArgumentError):
            manager.make_request("r", [1, -1])


# HASH-1 against vLLM 0.33 itself: block hashes of 32-token prompts (tokens 0..31,
# block size 16, sha256, no PYTHONHASHSEED) as vLLM 0.33's own request block hasher
# computes them, recorded once from vLLM 0.33.0. Pins the tagged extra keys and the
# default seed (D-HASH-1, D-HASH-7).
VLLM_0_33_SHA256_VECTORS: dict[str, tuple[str, str]] = {
    "plain": ("fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
              "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629"),
    "salt": ("3a829f0539d3fc466ecb0a98675d6c3525ac5e6e55c514c11493ed5395a6c869",
             "ec4898db6f568574d4f1fdbf417ebd0783c0a3c7af523565bb46acb5c8cc2f0f"),
    "lora": ("265783de243922d9a781ff05532f05b64e834b4f3ed205f25d14dc83d1ae37a0",
             "58eb349005f06f76464c0bd1e3beeccfd40eb2b10acc97a3d9968274bd638142"),
}


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", sorted(VLLM_0_33_SHA256_VECTORS))
def test_sha256_hashes_equal_vllm_0_33(name: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    module: Any = IMPLEMENTATIONS[name]
    config = KVCacheConfig(16, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(16, 1, 8, "float16")),))
    manager = module.KVCacheManager(config, max_model_len=64, hash_fn="sha256")
    extras: dict[str, dict[str, Any]] = {
        "salt": {"cache_salt": "a"}, "lora": {"lora_name": "ad", "lora_id": 3, "lora_path": "/p/ad"}}
    extra = extras.get(case, {})
    request = manager.make_request("r", list(range(32)), **extra)
    assert [h.hex() for h in request.block_hashes] == list(VLLM_0_33_SHA256_VECTORS[case])


def test_extra_keys_are_tagged_by_source() -> None:
    request = MMFeatureRequest()
    keys, _ = block_extra_keys(request, 0, 4, 0)
    assert keys == (("lora", "ad", "/p"), ("mm", "img", 2), ("cache_salt", "t"))
    keys, _ = block_extra_keys(request, 4, 8, 0)
    assert keys == (("lora", "ad", "/p"), ("mm", "img", -2))


class MMFeatureRequest:
    """A request with a LoRA adapter (name and path), an image at tokens 2..7, a salt."""

    all_token_ids = list(range(12))
    num_tokens = 12
    block_hashes: list[BlockHash] = []
    lora_id = 1
    lora_name = "ad"
    lora_path = "/p"
    cache_salt = "t"
    mm_features = (MMFeature("img", 2, 6),)


# -- lookahead hashing (spec/hashing.md section 7, D-HASH-10) ----------------


def expected_lookahead_hashes(request: Any, hash_fn: str, block_size: int, lookahead: int) -> list[bytes]:
    """HASH-1 with lookahead written out: a block is hashed once the
    ``lookahead`` tokens after it exist; its extra keys are the window's keys
    (rescanned from 0) followed by those tokens."""
    name = normalize_hash_fn(hash_fn)
    parent = seed_hash(name)
    hashes: list[bytes] = []
    tokens = request.all_token_ids
    for index in range(max(0, request.num_tokens - lookahead) // block_size):
        start, end = index * block_size, (index + 1) * block_size
        window = block_extra_keys(request, start, end + lookahead, 0)[0]
        extra = (window, *tokens[end:end + lookahead]) if lookahead else window
        parent = hash_block_tokens(name, parent, tokens[start:end], extra)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@given(
    hash_fn=st.sampled_from(["sha256", "sha256_cbor", "xxh3_128"]),
    block_size=st.sampled_from([1, 2, 4]),
    lookahead=st.integers(0, 5),
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    appends=st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=7), max_size=4),
    salt=st.sampled_from([None, "salt"]),
    image=st.booleans(),
)
def test_lookahead_hashes_cover_the_next_tokens(name: str, hash_fn: str, block_size: int, lookahead: int,
                                                prompt: list[int], appends: list[list[int]],
                                                salt: str | None, image: bool) -> None:
    impl: ModuleType = IMPLEMENTATIONS[name]
    config = KVCacheConfig(4, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(block_size, 1, 8, "float16")),))
    manager = impl.KVCacheManager(config, 1024, hash_fn=hash_fn, num_hash_lookahead_tokens=lookahead)
    features = (MMFeature("img", len(prompt) // 2, max(1, len(prompt) // 4)),) if image else ()
    request = manager.make_request("r", prompt, cache_salt=salt, mm_features=features)
    assert request.block_hashes == expected_lookahead_hashes(request, hash_fn, block_size, lookahead)
    for tokens in appends:
        request.append_output_token_ids(tokens)
        assert request.block_hashes == expected_lookahead_hashes(request, hash_fn, block_size, lookahead)


# Lookahead block hashes as vLLM 0.33's own hasher computes them
# (``get_request_block_hasher(4, sha256, L)``), tokens 0..22, block size 4, no
# PYTHONHASHSEED; the image case has inputs at tokens [6, 11) and [12, 14).
# (case: (lookahead, first block hash, fifth block hash)), recorded once from vLLM 0.33.0.
VLLM_0_33_LOOKAHEAD_VECTORS: dict[str, tuple[int, str, str]] = {
    "plain": (1, "9037ddb8bc597d6e73801cb0765d56afdcf25a7765334ee3563a343729b362e8",
              "defa86f29b497b8037a1f28985c7fd180fa9fd3d31e9d626e1f8655215cbd9ad"),
    "salt": (2, "951f0964c2497be18bc8c642d5bd5d2d62773227085b4975bef89a93b3630032",
             "669bd7c804552be5420888bffff051efe60f36cb729e70e42944c0fa195e0a59"),
    "mm": (3, "1021c07c65927bfaf7a158975c098b8b5ef4983152755e90bf0c7e0e147323cd",
           "ea840eaa89418a665e32e1d7131254a00a7ed1bd264bb24f0168605ce3366ea2"),
    "lora": (2, "554abc4485298131ff364e0ec2854b909a8b4928025d3a553755fe2ed6721f94",
             "f6d22de8ec72fffbafca5523f096a0b058b5dde9a698239739565d8980de0164"),
}


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", sorted(VLLM_0_33_LOOKAHEAD_VECTORS))
def test_lookahead_sha256_hashes_equal_vllm_0_33(name: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    module: Any = IMPLEMENTATIONS[name]
    lookahead, first, fifth = VLLM_0_33_LOOKAHEAD_VECTORS[case]
    config = KVCacheConfig(16, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(4, 1, 8, "float16")),))
    manager = module.KVCacheManager(config, max_model_len=64, num_hash_lookahead_tokens=lookahead)
    extras: dict[str, dict[str, Any]] = {
        "salt": {"cache_salt": "tenant"},
        "mm": {"mm_features": (MMFeature("img", 6, 5), MMFeature("img2", 12, 2))},
        "lora": {"lora_name": "ad", "lora_id": 3, "lora_path": "/p/ad"}}
    request = manager.make_request("r", list(range(23)), **extras.get(case, {}))
    assert len(request.block_hashes) == 5
    assert (request.block_hashes[0].hex(), request.block_hashes[4].hex()) == (first, fifth)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("hash_fn", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_events_let_a_consumer_recompute_lookahead_hashes(name: str, hash_fn: str, lookahead: int) -> None:
    """spec/hashing.md section 8: a BlockStored event carries each block's
    extra keys and lookahead tokens, enough to recompute its hashes."""
    module: Any = IMPLEMENTATIONS[name]
    config = KVCacheConfig(16, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(2, 1, 8, "float16")),))
    manager = module.KVCacheManager(config, 64, hash_fn=hash_fn, enable_kv_cache_events=True,
                                    num_hash_lookahead_tokens=lookahead)
    request = manager.make_request("r", list(range(9)), cache_salt="t",
                                   mm_features=(MMFeature("img", 4, 2),))
    assert manager.allocate_slots(request, request.num_tokens) is not None
    (event,) = manager.take_events()
    assert (event.lookahead_token_ids is None) == (lookahead == 0)
    assert event.extra_keys is not None and len(event.extra_keys) == len(event.block_hashes)
    parent = seed_hash(normalize_hash_fn(hash_fn))
    for index, block_hash in enumerate(event.block_hashes):
        keys = event.extra_keys[index]
        extra = (keys, *event.lookahead_token_ids[index]) if event.lookahead_token_ids is not None else keys
        parent = hash_block_tokens(normalize_hash_fn(hash_fn), parent,
                                   event.token_ids[2 * index:2 * index + 2], extra)
        assert parent == block_hash
    assert list(event.block_hashes) == request.block_hashes


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("bad", [-1, True, 1.0, "1"])
def test_malformed_lookahead_is_refused(name: str, bad: object) -> None:
    module: Any = IMPLEMENTATIONS[name]
    config = KVCacheConfig(16, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(2, 1, 8, "float16")),))
    for option in ("num_hash_lookahead_tokens", "num_prefill_lookahead"):
        with pytest.raises(InvalidConfigError, match=option):
            module.KVCacheManager(config, 64, **{option: bad})


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("prefill_lookahead,cached_tokens", [(0, 8), (1, 8), (2, 6), (3, 6), (5, 4)])
def test_reprefilled_tokens_are_not_cached(name: str, prefill_lookahead: int, cached_tokens: int) -> None:
    """D-HASH-12: a multi-module drafter re-prefills the last
    ``num_prefill_lookahead - 1`` computed tokens, so their blocks are not
    cached until later tokens push them out of that tail."""
    module: Any = IMPLEMENTATIONS[name]
    config = KVCacheConfig(16, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(2, 1, 8, "float16")),))
    manager = module.KVCacheManager(config, 64, num_prefill_lookahead=prefill_lookahead)
    request = manager.make_request("r", list(range(9)))
    assert manager.allocate_slots(request, 8) is not None
    probe = manager.make_request("probe", list(range(9)))
    assert manager.get_computed_blocks(probe)[1] == cached_tokens
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1) is not None  # 9 computed: one more token final
    probe = manager.make_request("probe2", list(range(11)))
    assert manager.get_computed_blocks(probe)[1] == min(8, (9 - max(0, prefill_lookahead - 1)) // 2 * 2)


# -- request creation: the prompt checked in one pass (issue 17, D-HASH-13) ----


@given(tokens=st.lists(st.one_of(st.integers(-2**33, 2**33), st.booleans(), st.floats(), st.none(),
                                 st.text(max_size=2), st.just(2**31 - 1), st.just(2**31), st.just(0)),
                       max_size=12))
def test_packed_prompt_is_the_tokens_as_uint32_or_none(tokens: list[Any]) -> None:
    """``pack_token_ids`` answers bytes exactly when every token is an int in
    [0, 2**31), and then they are the tokens as little-endian uint32."""
    packed = pack_token_ids(tokens)
    valid = all(type(token) is int and 0 <= token < 2**31 for token in tokens)
    assert (packed is not None) == valid
    if packed is not None:
        assert packed == b"".join(token.to_bytes(4, "little") for token in tokens)


def test_packed_prompt_refuses_numpy_and_int_subclasses() -> None:
    import enum

    import numpy as np

    class Token(enum.IntEnum):
        A = 3

    bad_lists: list[list[Any]] = [[np.int64(3)], [1, np.int32(2)], [Token.A], [True, 1], [[1]]]
    for bad in bad_lists:
        assert pack_token_ids(bad) is None


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("hash_fn", ["sha256", "xxh3_128"])
def test_prompt_bytes_do_not_change_hashes(name: str, hash_fn: str) -> None:
    """A prompt with a token >= 2**31 has no packed bytes; its hashes and a
    packed prompt's follow the same chain (HASH-1)."""
    module: Any = IMPLEMENTATIONS[name]
    config = KVCacheConfig(16, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(4, 1, 8, "float16")),))
    manager = module.KVCacheManager(config, 64, hash_fn=hash_fn)
    for prompt in (list(range(13)), [2**31 + 5] + list(range(12))):
        request = manager.make_request(f"r{prompt[0]}", prompt)
        assert (request.prompt_token_bytes is None) == (prompt[0] >= 2**31)
        request.append_output_token_ids([7, 8, 9])
        assert request.block_hashes == expected_hashes(request, hash_fn, 4)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@given(
    block_size=st.sampled_from([4, 5, 16, 64]),
    prompt=st.lists(st.one_of(st.integers(0, 300), st.integers(60_000, 70_000),
                              st.sampled_from([0, 255, 256, 65535, 65536, 2**31 - 1])),
                    min_size=1, max_size=200),
    appends=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=9), max_size=3),
)
def test_sha256_prompt_hashes_at_every_encoding_width(name: str, block_size: int, prompt: list[int],
                                                      appends: list[list[int]]) -> None:
    """HASH-1 for sha256 where the optimized hasher cuts the blocks' pickles
    from one pickle of the prompt: ids on both sides of 256, 65536 and 2**31."""
    module: Any = IMPLEMENTATIONS[name]
    config = KVCacheConfig(4, (), (KVCacheGroupSpec(("l",), FullAttentionSpec(block_size, 1, 8, "float16")),))
    manager = module.KVCacheManager(config, 4096, hash_fn="sha256")
    request = manager.make_request("r", prompt)
    assert request.block_hashes == expected_hashes(request, "sha256", block_size)
    for tokens in appends:
        request.append_output_token_ids(tokens)
        assert request.block_hashes == expected_hashes(request, "sha256", block_size)
