"""Simulated requests: deterministic tokens from block ids, hashed once.

A trace gives block ids, not tokens; the manager needs block hashes (and,
for ``BlockStored`` events, token ids). This module makes both:

- :class:`TokenSource` turns a block id into ``block_tokens`` deterministic
  tokens: three tokens spelling the id (so distinct ids never share
  content) followed by a window of a seeded random token stream chosen by
  the id. A partial last block is a prefix of the same tokens, so a prompt
  ending inside a block agrees with a longer prompt through the block.
- :class:`SimRequest` is a request the manager reads through
  :class:`pagedkv.spec.RequestView` (an engine may bring its own request
  type). Its ``all_token_ids`` is a lazy view that builds tokens only for
  the slices asked for (the block hasher on a miss, ``BlockStored``
  events): the 145 M prompt tokens of the Mooncake conversation trace are
  never all materialised.
- :class:`PrefixHasher` gives a request its block hashes with the manager's
  own hash function (``pagedkv.optimized.make_block_hasher``, the function
  ``KVCacheManager.make_request`` uses) and memoises them per (parent hash,
  block content): a block shared by many prompts is hashed once. The memo
  is keyed by content, so its hashes are the ones hashing the tokens gives
  (tests/test_simulate_requests.py checks them against ``make_request``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Final, overload

from pagedkv.optimized import make_block_hasher
from pagedkv.spec.types import BlockHash

__all__ = ["TokenSource", "SimRequest", "PrefixHasher", "OUTPUT_TOKEN", "content_key"]

_STREAM: Final = 1 << 14
OUTPUT_TOKEN: Final = 7
"""The token every simulated decode step produces (outputs are never shared)."""


def content_key(block_ids: Sequence[int], index: int, hash_block_size: int,
                block_tokens: int) -> tuple[int, ...]:
    """What hash block ``index`` (tokens ``[index*h, (index+1)*h)``) holds,
    named by trace block ids: ``(id, offset)`` when it lies in one trace
    block, else ``(ids..., offset)``. Cost: O(ids spanned)."""
    start = index * hash_block_size
    first, offset = divmod(start, block_tokens)
    last = (start + hash_block_size - 1) // block_tokens
    if first == last:
        return (block_ids[first], offset)
    return (*block_ids[first:last + 1], offset)


class TokenSource:
    """Deterministic tokens for block ids (see the module docstring)."""

    def __init__(self, block_tokens: int, seed: int = 0, vocab_size: int = 32000) -> None:
        if block_tokens < 4:
            raise ValueError(f"block_tokens must be >= 4, got {block_tokens}")
        rng = random.Random(seed)
        self.block_tokens = block_tokens
        self._stream = [rng.randrange(vocab_size) for _ in range(_STREAM + block_tokens)]

    def block(self, block_id: int) -> list[int]:
        """The ``block_tokens`` tokens of ``block_id``. Cost: O(block_tokens)."""
        out: list[int] = []
        self.extend(out, block_id, 0, self.block_tokens)
        return out

    def extend(self, out: list[int], block_id: int, start: int, stop: int) -> None:
        """Append tokens ``[start, stop)`` of ``block_id`` to ``out``. Cost:
        O(stop - start), in C but for the three id tokens."""
        if start < 3:
            out += ((block_id >> 32) & 0xFFFF, (block_id >> 16) & 0xFFFF, block_id & 0xFFFF)[start:stop]
            start = 3
        if stop > start:
            offset = (block_id * 2654435761) % _STREAM - 3
            out += self._stream[offset + start:offset + stop]


class _Tokens(Sequence[int]):
    """The lazy ``all_token_ids`` of a :class:`SimRequest`."""

    __slots__ = ("_request",)

    def __init__(self, request: SimRequest) -> None:
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        request = self._request
        if isinstance(index, slice):
            start, stop, step = index.indices(request.num_tokens)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return request.tokens(start, stop)
        if index < 0:
            index += request.num_tokens
        if not 0 <= index < request.num_tokens:
            raise IndexError(index)
        return request.tokens(index, index + 1)[0]


class SimRequest:
    """A request replayed from a trace; satisfies :class:`pagedkv.spec.RequestView`.

    ``block_hashes`` are set by :class:`PrefixHasher` at creation and grow as
    output tokens complete blocks (``append_output_token_ids``), as
    :class:`pagedkv.spec.Request`'s do.
    """

    __slots__ = (
        "request_id", "block_ids", "num_prompt_tokens", "num_computed_tokens", "block_hashes",
        "num_preemptions", "num_output_tokens", "num_tokens", "_hash_block_size", "_source", "_hasher",
        "all_token_ids", "_last_slice",
    )
    lora_id: Final = None
    lora_name: Final = None
    cache_salt: Final = None
    mm_features: Final[tuple[Any, ...]] = ()
    skip_reading_prefix_cache: Final = False

    def __init__(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                 source: TokenSource, hasher: PrefixHasher) -> None:
        self.request_id = request_id
        self.block_ids = block_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_output_tokens = 0
        self.num_tokens = num_prompt_tokens  # prompt plus output tokens
        self._hash_block_size = hasher.hash_block_size
        self.block_hashes: list[BlockHash] = []
        self._source = source
        self._hasher = hasher
        self.all_token_ids: Sequence[int] = _Tokens(self)
        self._last_slice: tuple[int, int, list[int]] = (0, 0, [])
        hasher.hash_prompt(self)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` (prompt tokens from the ids, then outputs).
        Cost: O(stop - start); the last slice is kept (do not mutate it):
        the hasher and the ``BlockStored`` event of a prefill ask for the same one."""
        if self._last_slice[0] == start and self._last_slice[1] == stop and stop <= self.num_prompt_tokens:
            return self._last_slice[2]
        out: list[int] = []
        source = self._source
        size = source.block_tokens
        ids = self.block_ids
        prompt_stop = min(stop, self.num_prompt_tokens)
        position = start
        if position < prompt_stop:
            index, offset = divmod(position, size)
            extend = source.extend
            while position < prompt_stop:
                take = min(size - offset, prompt_stop - position)
                extend(out, ids[index], offset, offset + take)
                position += take
                index += 1
                offset = 0
        if stop > position:
            out += [OUTPUT_TOKEN] * (stop - position)
        self._last_slice = (start, stop, out)
        return out

    def append_output_token_ids(self, count: int = 1) -> None:
        """``count`` more output tokens; hashes the blocks they complete."""
        self.num_output_tokens += count
        self.num_tokens += count
        # Only a token that completes a block needs the hasher.
        if count != 1 or self.num_tokens % self._hash_block_size == 0:
            self._hasher.hash_new_blocks(self)

    def __repr__(self) -> str:
        return (f"SimRequest({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")


class PrefixHasher:
    """Block hashes for :class:`SimRequest`, memoised per block content.

    Args:
        hash_fn, hash_block_size, seed: as the manager's (``KVCacheManager``
            ``hash_fn``, ``hash_block_size``, ``hash_seed``).
        block_tokens: tokens per trace block id.

    A hash block covers tokens ``[i*h, (i+1)*h)``: its content is named by the
    ids it spans and its offset in the first; with its parent hash that key
    determines the hash. A request's prompt hashes come from the memo until
    the first miss, then from the real hasher for the rest (in a Mooncake
    trace a miss is never followed by a hit within a prompt).
    Cost: O(1) per memoised block, O(h) per hashed one.
    """

    def __init__(self, hash_fn: str, hash_block_size: int, block_tokens: int,
                 seed: str | None = None, max_entries: int = 4_000_000) -> None:
        self.hash_block_size = hash_block_size
        self.block_tokens = block_tokens
        self._hash: Callable[[Any], list[BlockHash]] = make_block_hasher(hash_fn, hash_block_size, seed)
        self._memo: dict[tuple[object, ...], BlockHash] = {}
        self._max_entries = max_entries
        self.hashed = 0
        self.memoised = 0

    def hash_prompt(self, request: SimRequest) -> None:
        """Set the hashes of the prompt's full blocks on a new request."""
        h = self.hash_block_size
        full = request.num_prompt_tokens // h
        hashes = request.block_hashes
        memo = self._memo
        parent: BlockHash | None = None
        ids = request.block_ids
        b = self.block_tokens
        if b % h == 0:  # the common case, inlined: each hash block lies in one trace block
            for index in range(full):
                first, offset = divmod(index * h, b)
                found = memo.get((parent, ids[first], offset))
                if found is None:
                    break
                hashes.append(found)
                parent = found
        else:
            for index in range(full):
                found = memo.get((parent, *content_key(ids, index, h, b)))
                if found is None:
                    break
                hashes.append(found)
                parent = found
        self.memoised += len(hashes)
        if len(hashes) < full:
            start = len(hashes)
            new = self._hash(request)
            self.hashed += len(new)
            if len(memo) + len(new) > self._max_entries:
                memo.clear()  # bounded memory on huge traces; correctness is unaffected
            for offset, block_hash in enumerate(new):
                memo[(parent, *content_key(ids, start + offset, h, b))] = block_hash
                parent = block_hash
            hashes.extend(new)

    def hash_new_blocks(self, request: SimRequest) -> None:
        """Hash the blocks completed since the last call (outputs: not memoised)."""
        if request.num_tokens // self.hash_block_size > len(request.block_hashes):
            new = self._hash(request)
            self.hashed += len(new)
            request.block_hashes.extend(new)
