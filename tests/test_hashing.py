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
