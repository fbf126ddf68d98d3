"""Fast request block hashers, byte-identical to ``pagedkv.spec.hashing``.

A hasher is called by :class:`pagedkv.spec.Request` whenever tokens arrive
and returns the hashes of the full blocks not yet in ``block_hashes``
(spec/hashing.md, HASH-1). The normative definition is
:func:`pagedkv.spec.hashing.hash_block_tokens`; these differ only in how
the bytes are produced:

- ``xxh3_128``: the newly covered tokens are converted to little-endian
  uint32 bytes once per call (``array('I')``, a C loop) and each block
  hashes ``parent + slice``; no per-token Python work.
- ``xxh3_128`` over a prompt: the bytes are the prompt's own
  ``prompt_token_bytes``, made while its tokens were checked (D-HASH-13).
- ``sha256`` over a prompt without extra keys: one pickle of all the new
  tokens, cut into the blocks' int encodings at offsets computed with numpy
  from the packed bytes (:func:`_sha256_prompt_blocks`); the bytes hashed
  are those of ``pickle.dumps`` per block.
- otherwise ``sha256`` / ``sha256_cbor``: the pickle / canonical CBOR
  encoders are C already; the saving is binding them to locals and
  skipping the extra-key scan when ``need_extra_keys`` is false.

Extra keys (LoRA, multimodal, cache salt) come from the spec's own
``block_extra_keys`` so they cannot drift from the definition; the
multimodal scan restarts at index 0 on each call and carries its index
across the blocks of that call, which gives the same keys as a scan from 0
for every block. With lookahead hashing (spec/hashing.md section 7) every
block's extra keys are a tuple (the window's keys, then the lookahead
tokens); the window keys come from the spec's ``window_extra_keys``.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import cast

import cbor2
import numpy as np
import xxhash

from pagedkv.optimized.native import TOKENS, NativeTokens
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hashing import (
    ExtraKeys,
    HashFnName,
    block_extra_keys,
    need_extra_keys,
    normalize_hash_fn,
    seed_hash,
    window_extra_keys,
)
from pagedkv.spec.request import Request
from pagedkv.spec.types import BlockHash

__all__ = ["make_block_hasher", "REQUEST_TYPE"]

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
# array('I') is the C unsigned int: 4 bytes on every platform CPython
# supports in practice; fall back to 'L' if not.
_U32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


def _tokens_le_u32(tokens: list[int]) -> bytes:
    """``tokens`` as little-endian uint32 bytes. Cost: O(len) in C."""
    try:
        packed = array(_U32, tokens)
    except OverflowError:
        raise InvalidArgumentError(
            "xxh3_128 hashing needs token ids in [0, 2**32); got "
            f"{min(tokens)}..{max(tokens)}") from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _extra_keys_per_block(request: Request, start: int, end: int, size: int,
                          lookahead: int) -> list[ExtraKeys]:
    """Extra keys of each full block in ``[start, end)``; with lookahead,
    ``(window keys, *the lookahead tokens)`` per block."""
    out: list[ExtraKeys] = []
    if lookahead:
        tokens = request.all_token_ids
        with_keys = need_extra_keys(request)
        for block_end in range(start + size, end + 1, size):
            window = window_extra_keys(request, block_end - size, block_end, lookahead) if with_keys else None
            out.append((window, *tokens[block_end:block_end + lookahead]))
        return out
    mm_index = 0
    for block_start in range(start, end, size):
        keys, mm_index = block_extra_keys(request, block_start, block_start + size, mm_index)
        out.append(keys)
    return out


def make_block_hasher(
    hash_fn: str, hash_block_size: int, seed: str | None = None, lookahead: int = 0,
) -> Callable[[Request], list[BlockHash]]:
    """A block hasher for :class:`pagedkv.spec.Request` hashing blocks of
    ``hash_block_size`` tokens with ``hash_fn`` and the seed hash of
    ``seed`` (see :func:`pagedkv.spec.hashing.seed_hash`); each hash also
    covers the ``lookahead`` tokens after its block (spec/hashing.md
    section 7).

    Cost of the hasher: O(new tokens) per call, O(1) when no block completes.

    Raises:
        InvalidArgumentError: unknown ``hash_fn`` or non-positive size.
    """
    name: HashFnName = normalize_hash_fn(hash_fn)
    if type(hash_block_size) is not int or hash_block_size < 1:
        raise InvalidArgumentError(
            f"hash_block_size must be a positive int, got {hash_block_size!r}")
    if type(lookahead) is not int or lookahead < 0:
        raise InvalidArgumentError(f"lookahead must be an int >= 0, got {lookahead!r}")
    size = hash_block_size
    root = seed_hash(name, seed)

    if name == "xxh3_128":
        return _xxh3_hasher(size, root, lookahead)
    return _sha_hasher(name, size, root, lookahead)


def _xxh3_hasher(size: int, root: BlockHash, lookahead: int) -> Callable[[Request], list[BlockHash]]:
    digest = xxhash.xxh3_128_digest
    dumps = pickle.dumps
    stride = 4 * size

    def hash_new_blocks(request: Request) -> list[BlockHash]:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes) * size
        end = len(tokens) - lookahead
        if end - start < size:
            return []  # decode fast path: no block completed
        end -= (end - start) % size
        parent: bytes = hashes[-1] if hashes else root
        # A request type of its own (the simulator's) may not carry the bytes.
        prompt_bytes = getattr(request, "prompt_token_bytes", None)
        if prompt_bytes is not None and end <= request.num_prompt_tokens:
            # The prompt's uint32 bytes, made while checking it: no conversion.
            packed = prompt_bytes[4 * start:4 * end]
        else:
            packed = _tokens_le_u32(tokens[start:end])
        # Plain bytes in the loop (BlockHash(...) is a call per block); typed once at the end.
        out: list[bytes] = []
        append = out.append  # local binding for the per-block loop
        if lookahead or need_extra_keys(request):
            extras = _extra_keys_per_block(request, start, end, size, lookahead)
            for i, keys in enumerate(extras):
                offset = i * stride
                tail = b"" if keys is None else b"\0" + dumps(keys, protocol=_PICKLE_PROTOCOL)
                parent = digest(parent + packed[offset:offset + stride] + tail)
                append(parent)
        else:
            for offset in range(0, len(packed), stride):
                parent = digest(parent + packed[offset:offset + stride])
                append(parent)
        return cast("list[BlockHash]", out)

    return hash_new_blocks


def _sha_hasher(name: HashFnName, size: int, root: BlockHash,
                lookahead: int) -> Callable[[Request], list[BlockHash]]:
    sha256 = hashlib.sha256
    # A partial is called in C: no Python frame per block.
    encode: Callable[[object], bytes] = (
        partial(pickle.dumps, protocol=_PICKLE_PROTOCOL) if name == "sha256"
        else partial(cbor2.dumps, canonical=True))

    by_whole_pickle = name == "sha256" and 4 <= size <= _MAX_WHOLE_PICKLE_BLOCK
    tokens_c = TOKENS
    by_c = tokens_c is not None and name == "sha256" and 4 <= size <= _MAX_C_PICKLE_BLOCK

    def hash_new_blocks(request: Request) -> list[BlockHash]:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes) * size
        end = len(tokens) - lookahead
        if end - start < size:
            return []
        end -= (end - start) % size
        parent: bytes = hashes[-1] if hashes else root
        out: list[bytes] = []
        append = out.append
        extras: list[ExtraKeys]
        if lookahead or need_extra_keys(request):
            extras = _extra_keys_per_block(request, start, end, size, lookahead)
        else:
            prompt_bytes = getattr(request, "prompt_token_bytes", None)
            in_prompt = prompt_bytes is not None and end <= request.num_prompt_tokens
            if tokens_c is not None and by_c:
                # The C pickling of every block (D-PERF-35); None: a token >= 2**31, use Python.
                hashed = (tokens_c.sha256_blocks(prompt_bytes, start, end, size, parent, sha256)
                          if in_prompt and prompt_bytes is not None else
                          _sha256_packed(tokens_c, tokens[start:end], size, parent))
                if hashed is not None:
                    return hashed
            if by_whole_pickle and in_prompt and prompt_bytes is not None:
                return _sha256_prompt_blocks(tokens, prompt_bytes, start, end, size, parent)
            extras = [None] * ((end - start) // size)
        # One tuple of the new tokens; a slice of a tuple is a tuple (no second copy per block).
        block_tokens = tuple(tokens[start:end])
        block_start = 0
        for keys in extras:
            parent = sha256(encode((parent, block_tokens[block_start:block_start + size], keys))).digest()
            append(parent)
            block_start += size
        return cast("list[BlockHash]", out)

    return hash_new_blocks


# optimized/_tokens.c pickles blocks of 4 to this many tokens (one pickle frame each).
_MAX_C_PICKLE_BLOCK = 8192


def _sha256_packed(tokens_c: NativeTokens, tokens: list[int], size: int, parent: bytes) -> list[BlockHash] | None:
    """The C hashes of whole blocks ``tokens`` (not a prompt's: packed here), or None."""
    packed = tokens_c.pack(tokens)
    return None if packed is None else tokens_c.sha256_blocks(packed, 0, len(tokens), size, parent,
                                                              hashlib.sha256)


# sha256 hashes pickle.dumps((parent, block tokens, None), protocol 5). For a 32-byte parent and
# n >= 4 tokens that is, byte for byte (one frame while it stays under 64 KiB):
#   PROTO 5, FRAME <len>, SHORT_BINBYTES parent, MEMOIZE, MARK, <ints>, TUPLE, MEMOIZE, NONE,
#   TUPLE3, MEMOIZE, STOP
# and each int in [0, 2**31) is BININT1 (2 bytes), BININT2 (3) or BININT (5), as in any
# protocol >= 1. So the blocks' int encodings can be cut from ONE pickle of all the new tokens,
# at offsets computed from the tokens' packed bytes (spec/hashing.md section 6), instead of one
# pickle.dumps per block -- the bytes hashed are the same (tests/test_hashing.py compares).
# Up to here one pickle of all tokens beats a pickle per block (the per-call cost is what it
# saves; at 512 tokens a block the extra numpy passes cost more). Hard limit: 5 bytes a token
# + 42 must stay one pickle frame (< 64 KiB).
_MAX_WHOLE_PICKLE_BLOCK = 128
_PICKLE_HEAD = b"\x80\x05\x95"
_PICKLE_PARENT = b"C "  # SHORT_BINBYTES of 32 bytes
_PICKLE_MARK = b"\x94("  # MEMOIZE, MARK
_PICKLE_TAIL = b"t\x94N\x87\x94."  # TUPLE, MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP


def _sha256_prompt_blocks(tokens: Sequence[int], prompt_bytes: bytes, start: int, end: int, size: int,
                          parent: bytes) -> list[BlockHash]:
    """The sha256 hashes of the full blocks of tokens ``[start, end)`` of a
    prompt without extra keys, every token below 2**31 (``prompt_bytes`` are
    their uint32 bytes). Cost: one pickle of the tokens, a few numpy passes,
    one SHA-256 per block."""
    values = np.frombuffer(prompt_bytes, "<u4", end - start, 4 * start).reshape(-1, size)
    # Bytes per block: 2 per token, +1 from 256 on, +2 more from 65536 on.
    lengths = (2 * size + np.count_nonzero(values > 255, axis=1)
               + 2 * np.count_nonzero(values > 65535, axis=1)).tolist()
    # Protocol 2 of a tuple of >= 4 ints: PROTO 2, MARK, then the ints.
    body = pickle.dumps(tuple(tokens[start:end]), 2)
    heads = _pickle_heads(size)
    sha256 = hashlib.sha256
    join = b"".join
    out: list[bytes] = []
    append = out.append
    offset = 3
    for length in lengths:
        stop = offset + length
        parent = sha256(join((heads[length - 2 * size], parent, _PICKLE_MARK, body[offset:stop],
                              _PICKLE_TAIL))).digest()
        append(parent)
        offset = stop
    return cast("list[BlockHash]", out)


@lru_cache(maxsize=8)
def _pickle_heads(size: int) -> tuple[bytes, ...]:
    """PROTO, FRAME and SHORT_BINBYTES' opcode for a block of ``size`` ints
    whose encodings take ``2 * size + i`` bytes, indexed by ``i``."""
    return tuple(_PICKLE_HEAD + (2 * size + extra + 42).to_bytes(8, "little") + _PICKLE_PARENT
                 for extra in range(3 * size + 1))


def _request_type() -> type[Request]:
    tokens_c = TOKENS
    if tokens_c is None:
        return Request
    pack = tokens_c.pack

    class NativeRequest(Request):
        """:class:`pagedkv.spec.Request`, its token ids checked and packed in C
        (``optimized/_tokens.c``, D-PERF-35): the same attributes, values and
        errors."""

        __slots__ = ()
        pack_tokens = staticmethod(pack)

    return NativeRequest


REQUEST_TYPE = _request_type()
"""The request type ``KVCacheManager.make_request`` builds: spec's
:class:`pagedkv.spec.Request`, or a subclass checking tokens in C when the
optional module is built."""
