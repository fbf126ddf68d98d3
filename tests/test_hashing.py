"""HASH-1: a request's block hashes are the chained hash of its full blocks,
for every implementation's hasher and every hash function."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from pagedkv.spec import FullAttentionSpec, InvalidArgumentError, KVCacheConfig, KVCacheGroupSpec, MMFeature
from pagedkv.spec.hashing import block_extra_keys, hash_block_tokens, need_extra_keys, normalize_hash_fn, seed_hash
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
