"""Block hashing: the normative definition (spec/hashing.md).

A block's hash chains on its parent's hash, so equal hashes mean equal
prefixes, not just equal blocks::

    hash(block i) = H((hash(block i-1), tokens of block i, extra keys of block i))
    hash(block -1) = the seed hash ("none hash")

Three functions ``H`` are offered, by name:

``"sha256"``
    SHA-256 of ``pickle.dumps((parent, tuple(tokens), extra_keys),
    protocol=pickle.HIGHEST_PROTOCOL)``: byte-identical to vLLM's default, so
    KV events interoperate with vLLM consumers.
``"sha256_cbor"``
    SHA-256 of the canonical CBOR encoding of the same triple: reproducible
    from any language.
``"xxh3_128"``
    xxHash3-128 (non-cryptographic, ~10x faster) of ``parent || tokens as
    little-endian uint32 || (b"" if no extra keys else b"\\0" + pickle of
    the extra keys)``. Token ids must lie in ``[0, 2**32)``. Not compatible
    with vLLM's hashes (spec/decisions.md, D-HASH-2).

Implementations may compute these faster but must produce the same bytes;
the functions here are what the tests compare against.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Final, Literal, Protocol, TypeAlias

import cbor2
import xxhash

from pagedkv.spec.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.spec.types import BlockHash

__all__ = [
    "HashFnName",
    "HASH_FUNCTIONS",
    "DEFAULT_SEED",
    "ExtraKeys",
    "MultiModalFeature",
    "HashedRequest",
    "normalize_hash_fn",
    "hash_block_tokens",
    "seed_hash",
    "need_extra_keys",
    "block_extra_keys",
    "check_lookahead",
    "num_hashable_blocks",
    "window_extra_keys",
    "lookahead_extra_keys",
    "event_block_keys",
]

HashFnName: TypeAlias = Literal["sha256", "sha256_cbor", "xxh3_128"]
HASH_FUNCTIONS: Final[tuple[HashFnName, ...]] = ("sha256", "sha256_cbor", "xxh3_128")
_ALIASES: Final[dict[str, HashFnName]] = {"xxhash": "xxh3_128", "xxh3": "xxh3_128"}

ExtraKeys: TypeAlias = tuple[object, ...] | None
"""Per-block extra keys, each a tuple tagged with its source, in this order:
``("lora", name, path)``, ``("mm", identifier, offset)`` per multimodal input,
``("cache_salt", salt)``; ``None`` when there are none (D-HASH-7)."""

DEFAULT_SEED: Final = "vllm-none-hash"
"""The chain's seed when neither an explicit seed nor ``PYTHONHASHSEED`` is
given: vLLM 0.33's fixed seed for its cryptographic hashes (D-HASH-1)."""


class MultiModalFeature(Protocol):
    """A multimodal input placed in the prompt: ``length`` placeholder tokens
    starting at token ``offset``, identified by ``identifier`` (a content hash
    supplied by the engine)."""

    @property
    def identifier(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


class HashedRequest(Protocol):
    """What hashing reads of a request."""

    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...
    @property
    def lora_id(self) -> int | None: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def mm_features(self) -> Sequence[MultiModalFeature]: ...


def normalize_hash_fn(name: str) -> HashFnName:
    """The canonical name of a hash function; raises on an unknown name."""
    if not isinstance(name, str):
        raise InvalidArgumentError(
            f"hash_fn must be one of {', '.join(HASH_FUNCTIONS)} (or 'xxhash'), got {name!r}")
    canonical = _ALIASES.get(name, name)
    for known in HASH_FUNCTIONS:
        if canonical == known:
            return known
    raise InvalidArgumentError(
        f"hash_fn must be one of {', '.join(HASH_FUNCTIONS)} (or 'xxhash'), got {name!r}"
    )


def _tokens_as_u32(tokens: Sequence[int]) -> bytes:
    try:
        return b"".join(t.to_bytes(4, "little") for t in tokens)
    except OverflowError:
        raise InvalidArgumentError(
            "xxh3_128 hashing needs token ids in [0, 2**32); got "
            f"{min(tokens)}..{max(tokens)}"
        ) from None


def hash_block_tokens(
    hash_fn: HashFnName,
    parent: bytes,
    tokens: Sequence[int],
    extra_keys: ExtraKeys = None,
) -> BlockHash:
    """The hash of one full block whose parent's hash is ``parent``."""
    triple = (parent, tuple(tokens), extra_keys)
    if hash_fn == "sha256":
        return BlockHash(hashlib.sha256(pickle.dumps(triple, protocol=pickle.HIGHEST_PROTOCOL)).digest())
    if hash_fn == "sha256_cbor":
        return BlockHash(hashlib.sha256(cbor2.dumps(triple, canonical=True)).digest())
    tail = b"" if extra_keys is None else b"\0" + pickle.dumps(extra_keys, protocol=pickle.HIGHEST_PROTOCOL)
    return BlockHash(xxhash.xxh3_128_digest(parent + _tokens_as_u32(tokens) + tail))


def seed_hash(hash_fn: HashFnName, seed: str | None = None) -> BlockHash:
    """The parent hash of a request's first block.

    The seed is ``seed`` if given, else ``$PYTHONHASHSEED`` if set, else
    :data:`DEFAULT_SEED` (deterministic across processes: D-HASH-1). For
    ``sha256`` this equals vLLM 0.33's NONE_HASH in both cases.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    if hash_fn == "sha256":
        return BlockHash(hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest())
    if hash_fn == "sha256_cbor":
        return BlockHash(hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest())
    return BlockHash(xxhash.xxh3_128_digest(seed.encode()))


def need_extra_keys(request: HashedRequest) -> bool:
    """Whether any block of ``request`` can carry extra keys."""
    return bool(request.mm_features) or request.lora_id is not None or (
        request.lora_name is not None) or bool(request.cache_salt)


def _lora_keys(request: HashedRequest) -> list[object]:
    # The adapter's name identifies its weights across restarts; its integer
    # id is only a fallback (D-HASH-3). The path is part of the key so that a
    # name re-pointed at other weights does not reuse their KV (D-HASH-7); it
    # is read only if the request type has one (RequestView does not require it).
    name: object = request.lora_name if request.lora_name is not None else request.lora_id
    if name is None:
        return []
    return [("lora", name, getattr(request, "lora_path", None))]


def _mm_keys(request: HashedRequest, start: int, end: int, mm_index: int) -> tuple[list[object], int]:
    """``("mm", identifier, offset of the input's start relative to the block
    start)`` for each multimodal input overlapping tokens ``[start, end)``, scanning
    from ``mm_index``; returns the keys and the index to resume from."""
    features = request.mm_features
    keys: list[object] = []
    index = mm_index
    while index < len(features):
        feature = features[index]
        first, stop = feature.offset, feature.offset + feature.length
        if stop <= start:
            index += 1  # the input ended before this block
            continue
        if first >= end:
            break  # the input starts after this block
        keys.append(("mm", feature.identifier, first - start))
        if stop <= end:
            index += 1  # ends inside this block: the next one may start here too
        else:
            break  # continues into the next block
    return keys, index


def block_extra_keys(request: HashedRequest, start: int, end: int, mm_index: int) -> tuple[ExtraKeys, int]:
    """Extra keys of the block of tokens ``[start, end)``.

    Order: LoRA key, multimodal keys, then the cache salt (first block only),
    each tagged with its source as vLLM 0.33 does (D-HASH-7). Returns
    ``(None, index)`` when the block has none.
    """
    mm, next_index = _mm_keys(request, start, end, mm_index)
    keys = _lora_keys(request) + mm
    if start == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    return (tuple(keys) if keys else None), next_index


# -- lookahead hashing (spec/hashing.md section 7) ---------------------------


def check_lookahead(name: str, value: object) -> int:
    """``value`` as a lookahead token count (an int ``>= 0``, bool refused).

    Raises:
        InvalidConfigError: naming ``name``.
    """
    if type(value) is not int or value < 0:
        raise InvalidConfigError(f"{name} must be an int >= 0, got {value!r}")
    return value


def num_hashable_blocks(num_tokens: int, hash_block_size: int, lookahead: int) -> int:
    """How many blocks of a request of ``num_tokens`` tokens have a hash:
    a block is hashed once it is full and the ``lookahead`` tokens after it
    exist (HASH-1)."""
    return max(0, num_tokens - lookahead) // hash_block_size


def window_extra_keys(request: HashedRequest, start: int, end: int, lookahead: int) -> ExtraKeys:
    """The extra keys of the block ``[start, end)`` hashed with ``lookahead``
    tokens: those of the window ``[start, end + lookahead)`` (a multimodal
    input that only the lookahead tokens touch counts; the salt still only
    on the first block). With ``lookahead == 0``, the block's own keys."""
    keys, _ = block_extra_keys(request, start, end + lookahead, 0)
    return keys


def lookahead_extra_keys(request: HashedRequest, start: int, end: int, lookahead: int) -> ExtraKeys:
    """What the block ``[start, end)`` hashes as its extra keys: with
    ``lookahead == 0`` its own keys; else ``(window keys, *tokens[end:end +
    lookahead])`` -- a tuple, never ``None`` (D-HASH-10)."""
    if not lookahead:
        return block_extra_keys(request, start, end, 0)[0]
    tokens = request.all_token_ids[end:end + lookahead]
    return (window_extra_keys(request, start, end, lookahead), *tokens)


def event_block_keys(
    request: HashedRequest, positions: Sequence[int], block_size: int, lookahead: int,
) -> tuple[tuple[ExtraKeys, ...] | None, tuple[tuple[int, ...], ...] | None]:
    """The ``extra_keys`` and ``lookahead_token_ids`` of a ``BlockStored``
    event whose hashes are those of the blocks at ``positions`` (of
    ``block_size`` tokens; spec/hashing.md section 8): per listed block, its
    window extra keys, or ``None`` for the whole event when none has any; per
    listed block, the ``lookahead`` tokens after it, or ``None`` without
    lookahead. A per-call event lists the positions it keyed, skipping gaps
    (D-EVT-15). Cost: O(1) for a request without extra keys and no lookahead."""
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    if lookahead:
        tokens = request.all_token_ids
        lookahead_token_ids = tuple(
            tuple(tokens[(index + 1) * block_size:(index + 1) * block_size + lookahead])
            for index in positions)
    if not need_extra_keys(request):
        return None, lookahead_token_ids
    keys = tuple(window_extra_keys(request, index * block_size, (index + 1) * block_size, lookahead)
                 for index in positions)
    return (keys if any(key is not None for key in keys) else None), lookahead_token_ids
