"""The request: what the manager reads of a request, and a concrete type.

The manager never owns requests. It reads the attributes of
:class:`RequestView` (a Protocol), so an engine can pass its own request
type. :class:`Request` is a ready-made one whose ``block_hashes`` grow as
tokens arrive, driven by the ``block_hasher`` the manager hands out
(``KVCacheManager.make_request``).
"""

from __future__ import annotations

import marshal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.hashing import MultiModalFeature
from pagedkv.spec.types import BlockHash

__all__ = ["RequestView", "Request", "RequestFacts", "MMFeature", "BlockHasher", "REQUEST_OPTIONS",
           "check_request_options", "pack_token_ids"]

#: The keyword arguments ``Request`` (and ``KVCacheManager.make_request``) accept.
REQUEST_OPTIONS = frozenset(
    {"lora_id", "lora_name", "lora_path", "cache_salt", "mm_features", "skip_reading_prefix_cache"})


def check_request_options(options: Iterable[str]) -> None:
    """Refuse keyword arguments ``Request`` does not take (a typed error
    instead of Python's ``TypeError``)."""
    unknown = sorted(set(options) - REQUEST_OPTIONS)
    if unknown:
        raise InvalidArgumentError(
            f"unknown request option(s) {', '.join(unknown)}; expected some of {sorted(REQUEST_OPTIONS)}")


class RequestView(Protocol):
    """The attributes a KV cache manager reads from a request.

    ``block_hashes[i]`` is the chained hash of full block ``i`` (at the
    manager's hash block size); it covers exactly the full blocks of
    ``all_token_ids``. ``num_computed_tokens`` is owned by the engine: it is
    the number of tokens whose KV is in the cache before this step.
    """

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def lora_id(self) -> int | None: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def mm_features(self) -> Sequence[MultiModalFeature]: ...
    @property
    def skip_reading_prefix_cache(self) -> bool: ...


BlockHasher = Callable[["Request"], list[BlockHash]]
"""Returns the hashes of the full blocks of a request not yet in its
``block_hashes`` (possibly none)."""


class RequestFacts:
    """A request's attributes read once: what an operation works from after
    it has read the engine's object (spec/operations.md, "Exception
    safety": engine code runs before the first change, never after).

    The sequences are the request's own objects, not copies. Read-only by
    convention (a plain slotted class: building one costs a fifth of a
    frozen dataclass, and it is built on every general ``allocate_slots``).
    """

    __slots__ = ("request_id", "all_token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens",
                 "block_hashes", "num_preemptions", "lora_id", "lora_name", "cache_salt", "mm_features",
                 "skip_reading_prefix_cache", "session_id", "lora_path", "shared_prefix_boundary")

    request_id: str
    all_token_ids: Sequence[int]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: Sequence[BlockHash]
    num_preemptions: int
    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None
    mm_features: Sequence[MultiModalFeature]
    skip_reading_prefix_cache: bool
    session_id: str | None
    """Not part of :class:`RequestView`: read if the request has it (events
    carry it, D-EVT-10), else ``None``."""
    lora_path: str | None
    """Not part of :class:`RequestView`: read if the request has it (events
    hash-key it with the LoRA name, D-HASH-7), else ``None``."""
    # Optional (not in RequestView): the junction the engine pinned from
    # get_computed_blocks' boundary; 0 when absent (spec/operations.md).
    shared_prefix_boundary: int

    def __init__(self, request: RequestView) -> None:
        """Read every attribute of ``request`` now.

        Raises:
            InvalidArgumentError: ``request`` lacks an attribute of
                :class:`RequestView`, or its ``request_id`` is not a str.
        """
        try:
            self.request_id = request.request_id
            self.all_token_ids = request.all_token_ids
            self.num_tokens = request.num_tokens
            self.num_prompt_tokens = request.num_prompt_tokens
            self.num_computed_tokens = request.num_computed_tokens
            self.block_hashes = request.block_hashes
            self.num_preemptions = request.num_preemptions
            self.lora_id = request.lora_id
            self.lora_name = request.lora_name
            self.cache_salt = request.cache_salt
            self.mm_features = request.mm_features
            self.skip_reading_prefix_cache = request.skip_reading_prefix_cache
            self.session_id = getattr(request, "session_id", None)
            self.lora_path = getattr(request, "lora_path", None)
            self.shared_prefix_boundary = getattr(request, "shared_prefix_boundary", 0)
        except AttributeError as error:
            raise InvalidArgumentError(f"request must have the attributes of RequestView: {error}") from None
        if not isinstance(self.request_id, str):
            raise InvalidArgumentError(f"request.request_id must be a str, got {self.request_id!r}")

    @classmethod
    def capture(cls, request: RequestView) -> RequestFacts:
        """``RequestFacts(request)``; a snapshot is taken as it is (read-only
        by convention, so a copy would equal it): an adapter that captures
        the engine's object itself passes the snapshot (D-PERF-12)."""
        if request.__class__ is cls:
            return request
        return cls(request)


@dataclass(frozen=True, slots=True)
class MMFeature:
    """A multimodal input occupying prompt tokens ``[offset, offset+length)``."""

    identifier: str
    offset: int
    length: int


_MARSHAL_INT = b"i"  # marshal's type byte of an int in [-2**31, 2**31)
_MARSHAL_ROW = np.dtype([("type", "u1"), ("value", "<u4")])  # packed: 5 bytes a row


def pack_token_ids(tokens: list[int]) -> bytes | None:
    """``tokens`` as little-endian uint32 bytes if every one is an ``int``
    (exactly: not a bool, a numpy integer or another subclass) in
    ``[0, 2**31)``; ``None`` otherwise (the caller then checks each token).

    One pass in C instead of a Python loop per token (checking each token
    in Python was most of ``make_request`` at block size 512): marshal
    (format version 2, no back-references) writes each exact int of that
    range as the byte ``i`` and the value as 4 little-endian bytes, and
    anything else -- a bool, a float, ``None``, a str, a larger int -- with
    another type byte or length, while an object it cannot write (a numpy
    integer, an int subclass) raises. Laid out as rows of 5 bytes, the list
    is valid iff the length is ``5 + 5 n``, every row starts with ``i`` and
    no value has its sign bit set, i.e. every row's last byte is ASCII (by
    induction from the first element, each row is one element). Cost: O(n),
    in C and numpy.
    """
    try:
        written = marshal.dumps(tokens, 2)
    except (ValueError, TypeError, RecursionError):
        return None
    count = len(tokens)
    # Byte slices with a step and isascii() run in C at well under a
    # nanosecond per token; so does the strided view of the values.
    if (len(written) != 5 + 5 * count or written[5::5] != _MARSHAL_INT * count
            or not written[9::5].isascii()):
        return None
    return np.frombuffer(written, _MARSHAL_ROW, count, 5)["value"].tobytes()


TokenPacker = Callable[[list[int]], "bytes | None"]
"""A function with :func:`pack_token_ids`' contract."""


def _check_token_ids(token_ids: object, what: str,
                     pack: TokenPacker = pack_token_ids) -> tuple[list[int], bytes | None]:
    """The tokens as a new list, and their uint32 bytes when ``pack`` has
    them; raises on anything but non-negative ints."""
    if isinstance(token_ids, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be a sequence of non-negative ints, got {token_ids!r}")
    try:
        tokens: list[int] = list(token_ids)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be a sequence of non-negative ints, got {token_ids!r}") from None
    packed = pack(tokens)
    if packed is None:
        # Something outside the packed range: find the first offender (or
        # accept large ints, which are valid token ids) token by token.
        for token in tokens:
            if type(token) is not int or token < 0:
                raise InvalidArgumentError(f"{what} must be non-negative ints, got {token!r}")
    return tokens, packed


class Request:
    """A request with incrementally maintained block hashes.

    Cost: creation hashes every full block of the prompt (O(prompt tokens));
    ``append_output_token_ids`` hashes only blocks that the new tokens
    complete.
    """

    __slots__ = (
        "request_id", "_all_token_ids", "num_prompt_tokens", "num_computed_tokens",
        "block_hashes", "num_preemptions", "lora_id", "lora_name", "lora_path", "cache_salt",
        "mm_features", "skip_reading_prefix_cache", "_block_hasher", "prompt_token_bytes",
        "shared_prefix_boundary",
    )

    #: Checks and packs the token ids (:func:`pack_token_ids`). A subclass may
    #: set an equivalent function -- same bytes, same ``None`` -- that runs
    #: faster; the optimized package's C one does (D-PERF-35).
    pack_tokens: ClassVar[staticmethod[[list[int]], bytes | None]] = staticmethod(pack_token_ids)

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        block_hasher: BlockHasher | None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        tokens, packed = _check_token_ids(prompt_token_ids, "prompt_token_ids", self.pack_tokens)
        if not tokens:
            raise InvalidArgumentError(f"request {request_id!r}: prompt_token_ids is empty")
        if lora_id is not None and (type(lora_id) is not int or lora_id < 0):
            raise InvalidArgumentError(f"lora_id must be a non-negative int or None, got {lora_id!r}")
        for name, value in (("lora_name", lora_name), ("cache_salt", cache_salt)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(f"{name} must be a str or None, got {value!r}")
        if type(skip_reading_prefix_cache) is not bool:
            raise InvalidArgumentError(
                f"skip_reading_prefix_cache must be a bool, got {skip_reading_prefix_cache!r}")
        try:
            features = tuple(mm_features)
        except TypeError:
            raise InvalidArgumentError(
                f"request {request_id!r}: mm_features must be a sequence of features, got {mm_features!r}") from None
        previous_end = 0
        for feature in features:
            identifier = getattr(feature, "identifier", None)
            offset, length = getattr(feature, "offset", None), getattr(feature, "length", None)
            if not isinstance(identifier, str) or type(offset) is not int or type(length) is not int:
                raise InvalidArgumentError(
                    f"request {request_id!r}: mm_features entries need a str identifier and int offset "
                    f"and length, got {feature!r}")
            if feature.offset < previous_end or feature.length <= 0 or (
                    feature.offset + feature.length > len(tokens)):
                raise InvalidArgumentError(
                    f"request {request_id!r}: mm_features must be sorted, non-overlapping, "
                    f"non-empty ranges inside the prompt; got offset={feature.offset} "
                    f"length={feature.length} (prompt has {len(tokens)} tokens)")
            previous_end = feature.offset + feature.length
        self.request_id = request_id
        self._all_token_ids = tokens
        # The prompt as little-endian uint32 bytes, a by-product of checking it
        # (None if a token is 2**31 or more): hashers may slice it instead of
        # converting the tokens again. Read-only by convention.
        self.prompt_token_bytes: bytes | None = packed
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self.lora_id = lora_id
        self.lora_name = lora_name
        # Hashed with the name (spec/hashing.md, D-HASH-7); not part of RequestView.
        self.lora_path = lora_path
        self.cache_salt = cache_salt
        self.mm_features: tuple[MultiModalFeature, ...] = features
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self._block_hasher = block_hasher
        # Set by the engine from get_computed_blocks' boundary (optional).
        self.shared_prefix_boundary = 0
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt tokens followed by output tokens (do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """``len(all_token_ids)``."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens appended after the prompt."""
        return len(self._all_token_ids) - self.num_prompt_tokens

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash any block they complete.

        Raises:
            InvalidArgumentError: a token that is not a non-negative int
                (``bool`` and numpy integers included); nothing is appended.
        """
        if type(token_ids) is int:
            if token_ids < 0:
                raise InvalidArgumentError(f"output token ids must be non-negative ints, got {token_ids}")
            self._all_token_ids.append(token_ids)
        else:
            self._all_token_ids.extend(_check_token_ids(token_ids, "output token ids", self.pack_tokens)[0])
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, "
                f"num_block_hashes={len(self.block_hashes)})")
