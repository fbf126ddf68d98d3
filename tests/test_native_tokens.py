"""The optional C token checks and prompt hashing (``optimized/_tokens.c``,
D-PERF-35) against the Python definitions they replace.

``pack`` must give exactly what ``spec.request.pack_token_ids`` gives (bytes
or ``None``) for any list, hostile ones included; ``sha256_blocks`` must give
the chain of ``sha256(pickle.dumps((parent, block, None), 5))`` digests
(spec/hashing.md, HASH-1) or ``None`` for what it does not cover; the request
type built on them must be indistinguishable from spec's ``Request``. Skipped,
with the reason, in a build without a C compiler (the Python paths then run,
and tests/test_hashing.py checks them).
"""

from __future__ import annotations

import enum
import hashlib
import pickle
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from pagedkv.optimized.native import TOKENS
from pagedkv.optimized.pool import hasher as hasher_module
from pagedkv.optimized.pool.hasher import REQUEST_TYPE, make_block_hasher
from pagedkv.spec import InvalidArgumentError, Request
from pagedkv.spec.hashing import seed_hash
from pagedkv.spec.request import pack_token_ids

needs_tokens = pytest.mark.skipif(TOKENS is None, reason="built without the C module (no C compiler, "
                                  "or PAGEDKV_PURE_PYTHON=1): the Python code runs, nothing to compare")

# Token ids on both sides of every pickle width (BININT1 / BININT2 / BININT) and of 2**31.
EDGES = (0, 255, 256, 65535, 65536, 2**30 - 1, 2**30, 2**31 - 1)
token_ids = st.one_of(st.integers(0, 300), st.integers(60_000, 70_000), st.integers(0, 2**31 - 1),
                      st.sampled_from(EDGES))


class Token(enum.IntEnum):
    A = 3


def definition(parent: bytes, tokens: list[int], size: int) -> list[bytes]:
    """HASH-1 with sha256 and no extra keys, written out."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % size, size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[start:start + size]), None), 5)).digest()
        out.append(parent)
    return out


@needs_tokens
@given(tokens=st.lists(st.one_of(token_ids, st.integers(-2**33, 2**65), st.booleans(), st.floats(), st.none(),
                                 st.text(max_size=2), st.just(2**31), st.just(-1),
                                 st.sampled_from([np.int64(3), np.uint32(7), Token.A])), max_size=40))
def test_pack_is_pack_token_ids(tokens: list[Any]) -> None:
    assert TOKENS is not None
    assert TOKENS.pack(tokens) == pack_token_ids(tokens)


@needs_tokens
def test_pack_refuses_what_is_not_a_list_of_token_ids() -> None:
    assert TOKENS is not None

    class Tokens(list[int]):
        pass

    not_a_list: Any = (1, 2, 3)
    assert TOKENS.pack(not_a_list) is None
    assert TOKENS.pack(Tokens([1, 2])) is None
    assert TOKENS.pack(list(EDGES)) == b"".join(t.to_bytes(4, "little") for t in EDGES)
    assert TOKENS.pack([]) == b""


@needs_tokens
@given(size=st.sampled_from([4, 5, 16, 127, 128, 129, 512]), blocks=st.integers(0, 4), skip=st.integers(0, 2),
       data=st.data())
def test_sha256_blocks_is_the_pickle_chain(size: int, blocks: int, skip: int, data: st.DataObject) -> None:
    assert TOKENS is not None
    tokens = data.draw(st.lists(token_ids, min_size=size * (blocks + skip), max_size=size * (blocks + skip) + 3))
    parent = data.draw(st.binary(min_size=32, max_size=32))
    packed = pack_token_ids(tokens)
    assert packed is not None
    start, end = skip * size, (skip + blocks) * size
    assert TOKENS.sha256_blocks(packed, start, end, size, parent, hashlib.sha256) == definition(
        parent, tokens[start:end], size)


@needs_tokens
def test_sha256_blocks_at_the_largest_block() -> None:
    """8192 tokens of the widest encoding: one pickle frame still."""
    assert TOKENS is not None
    tokens = [2**31 - 1 - i for i in range(2 * 8192)]
    packed = pack_token_ids(tokens)
    assert packed is not None
    root = seed_hash("sha256")
    assert TOKENS.sha256_blocks(packed, 0, len(tokens), 8192, root, hashlib.sha256) == definition(
        root, tokens, 8192)


@needs_tokens
@pytest.mark.parametrize("args", [
    (0, 8, 3), (0, 8, 8193), (0, 6, 4), (4, 0, 4), (-4, 4, 4), (0, 12, 4), (0, 2**80, 4),
], ids=repr)
def test_sha256_blocks_refuses_what_it_does_not_cover(args: tuple[int, int, int]) -> None:
    assert TOKENS is not None
    packed = bytes(8 * 4)  # eight tokens
    start, end, size = args
    assert TOKENS.sha256_blocks(packed, start, end, size, bytes(32), hashlib.sha256) is None


@needs_tokens
def test_sha256_blocks_refuses_foreign_arguments_and_wide_tokens() -> None:
    assert TOKENS is not None
    packed = bytes(16)
    sha = hashlib.sha256
    foreign: list[tuple[Any, Any, Any, Any, Any]] = [
        (bytearray(packed), 0, 4, 4, bytes(32)), (packed, 0, 4, 4, bytes(31)),
        (packed, 0.0, 4, 4, bytes(32)), (packed, 0, 4, 4, bytearray(32))]
    for data, start, end, size, parent in foreign:
        assert TOKENS.sha256_blocks(data, start, end, size, parent, sha) is None
    # A token of 2**31 or more (pack never makes one): pickled as LONG1, not covered.
    wide = (2**31).to_bytes(4, "little") + bytes(12)
    assert TOKENS.sha256_blocks(wide, 0, 4, 4, bytes(32), sha) is None
    assert TOKENS.sha256_blocks(bytes(4) + wide, 0, 8, 4, bytes(32), sha) is None  # in the second block


@needs_tokens
def test_sha256_blocks_passes_on_a_hash_error() -> None:
    assert TOKENS is not None

    def short_digest(data: bytes) -> Any:
        return hashlib.md5(data)

    def failing(data: bytes) -> Any:
        raise OSError("no hash")

    with pytest.raises(TypeError, match="32 bytes"):
        TOKENS.sha256_blocks(bytes(16), 0, 4, 4, bytes(32), short_digest)
    with pytest.raises(OSError, match="no hash"):
        TOKENS.sha256_blocks(bytes(16), 0, 4, 4, bytes(32), failing)


def attributes(request: Request) -> dict[str, Any]:
    return {name: getattr(request, name) for name in (
        "request_id", "all_token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "block_hashes",
        "prompt_token_bytes", "lora_name", "cache_salt", "mm_features")}


@given(prompt=st.lists(st.one_of(token_ids, st.just(2**31 + 1)), min_size=1, max_size=80),
       appends=st.lists(st.lists(token_ids, min_size=1, max_size=20), max_size=3),
       hash_fn=st.sampled_from(["sha256", "xxh3_128", "sha256_cbor"]), size=st.sampled_from([1, 4, 16]))
def test_make_request_type_is_spec_request(prompt: list[int], appends: list[list[int]], hash_fn: str,
                                           size: int) -> None:
    """The request type the optimized manager builds (C checks when built)
    has every attribute of spec's Request, after every append."""
    hasher = make_block_hasher(hash_fn, size)
    ours, spec = REQUEST_TYPE("r", prompt, block_hasher=hasher), Request("r", prompt, block_hasher=hasher)
    assert isinstance(ours, Request)
    assert attributes(ours) == attributes(spec)
    for tokens in appends:
        ours.append_output_token_ids(tokens)
        spec.append_output_token_ids(tokens)
        assert attributes(ours) == attributes(spec)


@pytest.mark.parametrize("bad", [[1, -1], [True], [1, 2.0], [np.int64(3)], [Token.A], "abc", -5], ids=repr)
def test_make_request_type_refuses_as_spec_request(bad: Any) -> None:
    errors = []
    for request_type in (REQUEST_TYPE, Request):
        with pytest.raises(InvalidArgumentError) as caught:
            request_type("r", bad, block_hasher=None)
        errors.append(str(caught.value))
        request = request_type("r", [1, 2], block_hasher=None)
        with pytest.raises(InvalidArgumentError) as caught:
            request.append_output_token_ids(bad)
        errors.append(str(caught.value))
        assert request.all_token_ids == [1, 2]
    assert errors[:2] == errors[2:]


@pytest.mark.parametrize("size", [4, 16, 128, 129, 512])
def test_python_and_c_hashers_agree(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hasher's Python paths (a build without the module) and its C path
    give the same hashes for prompts and appended tokens."""
    prompt = [(i * 7919) % 70_000 for i in range(3 * size + 5)]
    c_hasher = make_block_hasher("sha256", size)
    monkeypatch.setattr(hasher_module, "TOKENS", None)
    python_hasher = make_block_hasher("sha256", size)
    hashes = []
    for hasher in (c_hasher, python_hasher):
        request = Request("r", prompt, block_hasher=hasher)
        request.append_output_token_ids(list(range(2 * size)))
        hashes.append(request.block_hashes)
        assert request.block_hashes == definition(seed_hash("sha256"), request.all_token_ids, size)
    assert hashes[0] == hashes[1]
