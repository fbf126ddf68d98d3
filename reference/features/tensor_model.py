"""Plain-Python model of the GPU tensor path (``pagedkv.optimized.tensor``).

The semantic model, written once and tested against the torch code:

- **Block tables.** Each KV cache group has a table of ``max_num_reqs`` rows.
  A row is either *free* or holds one request's block ids for that group, in
  order (position ``i`` is the block holding tokens
  ``[i * block_size, (i + 1) * block_size)``). Skipped blocks (sliding window,
  chunked local attention) are the null block ``0``. Every table entry past a
  row's length is ``0`` too, so a padded read lands in the null block.
- **Slot mapping.** Token ``p`` of the request in row ``r`` of group ``g`` goes
  to slot ``table_g[r][p // block_size_g] * block_size_g + p % block_size_g``.
  Padding tokens get :data:`PAD_SLOT_ID`.
- **Caches.** A cache is a list of tensors, each a list of ``num_blocks``
  pages (``bytes``): block ``b`` of every layer viewing tensor ``t`` lives in
  page ``b`` of ``t``. Copying block pairs ``(src, dst)`` sets, for every
  tensor of the group, ``page[dst] = old page[src]`` -- all sources are read
  before any destination is written, so a batch may read a block another pair
  of the same batch overwrites. Swapping is the same between two caches.

No torch here: this module is the oracle for the differential tests, kept
simple enough to read in minutes. Costs are not a concern.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.spec.errors import InvalidArgumentError, UnknownBlockError
from pagedkv.spec.kv_cache_spec import (
    FP8_DS_MLA,
    FP8_DS_MLA_BYTES_PER_TOKEN,
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    dtype_size,
)
from pagedkv.spec.mamba_spec import MambaSpec

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "check_block_pairs",
    "ReferenceBlockTables",
    "reference_token_batch",
    "reference_slot_mapping",
    "reference_slot_mapping_padded",
    "ReferenceCache",
    "reference_copy_blocks",
    "reference_swap_blocks",
    "reference_byte_offset",
]

NULL_BLOCK_ID = 0
"""The null block: placeholder for skipped blocks and for unused table entries."""

PAD_SLOT_ID = -1
"""Slot of a padding token; attention kernels skip writes to negative slots."""


def _check_int(name: str, value: object) -> int:
    if type(value) is not int:
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    return value


def check_block_pairs(pairs: Sequence[tuple[int, int]], src_num_blocks: int,
                      dst_num_blocks: int) -> None:
    """Raise unless every ``(src, dst)`` pair is a valid block move.

    Valid: ``0 <= src < src_num_blocks``; ``1 <= dst < dst_num_blocks`` (the
    null block is never written); no destination twice.

    Raises:
        InvalidArgumentError: a pair is not two ints, the null block is a
            destination, or a destination repeats.
        UnknownBlockError: a block id is out of range.
    """
    seen: set[int] = set()
    for i, pair in enumerate(pairs):
        if len(pair) != 2:
            raise InvalidArgumentError(f"pair {i} must be (src, dst), got {pair!r}")
        src = _check_int(f"pair {i} src", pair[0])
        dst = _check_int(f"pair {i} dst", pair[1])
        if not 0 <= src < src_num_blocks:
            raise UnknownBlockError(
                f"pair {i}: source block {src} outside [0, {src_num_blocks})")
        if not 0 <= dst < dst_num_blocks:
            raise UnknownBlockError(
                f"pair {i}: destination block {dst} outside [0, {dst_num_blocks})")
        if dst == NULL_BLOCK_ID:
            raise InvalidArgumentError(f"pair {i}: the null block 0 cannot be a destination")
        if dst in seen:
            raise InvalidArgumentError(f"pair {i}: destination block {dst} appears twice")
        seen.add(dst)


class ReferenceBlockTables:
    """Block tables of every KV cache group, as lists of lists.

    Same operations and errors as ``pagedkv.optimized.tensor.BlockTables``;
    see the module docstring for the model.
    """

    def __init__(self, block_sizes: Sequence[int], max_num_reqs: int,
                 max_blocks_per_req: Sequence[int], num_blocks: int) -> None:
        if len(block_sizes) != len(max_blocks_per_req) or not block_sizes:
            raise InvalidArgumentError("one block size and one max_blocks_per_req per group")
        self.block_sizes = list(block_sizes)
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = list(max_blocks_per_req)
        self.num_blocks = num_blocks
        # rows[g][r] is None for a free row, else the row's block ids.
        self.rows: list[list[list[int] | None]] = [
            [None] * max_num_reqs for _ in block_sizes]

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def _row(self, row: object) -> int:
        r = _check_int("row", row)
        if not 0 <= r < self.max_num_reqs:
            raise InvalidArgumentError(f"row {r} outside [0, {self.max_num_reqs})")
        return r

    def is_occupied(self, row: int) -> bool:
        return self.rows[0][self._row(row)] is not None

    def _check_ids(self, block_ids: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        if len(block_ids) != self.num_groups:
            raise InvalidArgumentError(
                f"block_ids must have one list per group ({self.num_groups}), "
                f"got {len(block_ids)}")
        for g, ids in enumerate(block_ids):
            for b in ids:
                _check_int(f"group {g} block id", b)
                if not 0 <= b < self.num_blocks:
                    raise UnknownBlockError(
                        f"group {g}: block id {b} outside [0, {self.num_blocks})")
            if lengths[g] + len(ids) > self.max_blocks_per_req[g]:
                raise InvalidArgumentError(
                    f"group {g}: {lengths[g] + len(ids)} blocks exceed "
                    f"max_blocks_per_req {self.max_blocks_per_req[g]}")

    def add_request(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        r = self._row(row)
        if self.rows[0][r] is not None:
            raise InvalidArgumentError(f"row {r} is already occupied")
        self._check_ids(block_ids, [0] * self.num_groups)
        for g, ids in enumerate(block_ids):
            self.rows[g][r] = list(ids)

    def append_blocks(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        r = self._row(row)
        if self.rows[0][r] is None:
            raise InvalidArgumentError(f"row {r} is free")
        self._check_ids(block_ids, [len(self.rows[g][r] or []) for g in range(self.num_groups)])
        for g, ids in enumerate(block_ids):
            current = self.rows[g][r]
            assert current is not None
            current.extend(ids)

    def set_null(self, row: int, group_id: int, start: int, stop: int) -> None:
        r = self._row(row)
        current = self.rows[0][r]
        if current is None:
            raise InvalidArgumentError(f"row {r} is free")
        g = _check_int("group_id", group_id)
        if not 0 <= g < self.num_groups:
            raise InvalidArgumentError(f"group_id {g} outside [0, {self.num_groups})")
        ids = self.rows[g][r]
        assert ids is not None
        if not 0 <= start <= stop <= len(ids):
            raise InvalidArgumentError(
                f"range [{start}, {stop}) outside the row's {len(ids)} blocks")
        for i in range(start, stop):
            ids[i] = NULL_BLOCK_ID

    def remove_request(self, row: int) -> None:
        r = self._row(row)
        if self.rows[0][r] is None:
            raise InvalidArgumentError(f"row {r} is free")
        for g in range(self.num_groups):
            self.rows[g][r] = None

    def move_row(self, src: int, dst: int) -> None:
        s, d = self._row(src), self._row(dst)
        if self.rows[0][s] is None:
            raise InvalidArgumentError(f"source row {s} is free")
        if self.rows[0][d] is not None:
            raise InvalidArgumentError(f"destination row {d} is occupied")
        for g in range(self.num_groups):
            self.rows[g][d], self.rows[g][s] = self.rows[g][s], None

    def swap_rows(self, a: int, b: int) -> None:
        ra, rb = self._row(a), self._row(b)
        for g in range(self.num_groups):
            self.rows[g][ra], self.rows[g][rb] = self.rows[g][rb], self.rows[g][ra]

    def condense(self) -> list[tuple[int, int]]:
        """Move the last occupied rows into the first free ones until the
        occupied rows are ``0 .. n-1``; return the moves ``(src, dst)``."""
        moves: list[tuple[int, int]] = []
        while True:
            free = [r for r in range(self.max_num_reqs) if self.rows[0][r] is None]
            used = [r for r in range(self.max_num_reqs) if self.rows[0][r] is not None]
            if not free or not used or free[0] > used[-1]:
                return moves
            self.move_row(used[-1], free[0])
            moves.append((used[-1], free[0]))

    def table(self, group_id: int) -> list[list[int]]:
        """The group's full table: each row padded with the null block."""
        width = self.max_blocks_per_req[group_id]
        return [(ids or []) + [NULL_BLOCK_ID] * (width - len(ids or []))
                for ids in self.rows[group_id]]

    def num_blocks_per_row(self, group_id: int) -> list[int]:
        return [len(ids or []) for ids in self.rows[group_id]]


def reference_token_batch(rows: Sequence[int], starts: Sequence[int],
                          counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per-token (row, position) of a batch where request ``i`` (table row
    ``rows[i]``) schedules ``counts[i]`` tokens from position ``starts[i]``."""
    token_rows: list[int] = []
    positions: list[int] = []
    for row, start, count in zip(rows, starts, counts, strict=True):
        token_rows.extend([row] * count)
        positions.extend(range(start, start + count))
    return token_rows, positions


def reference_slot_mapping(table: Sequence[Sequence[int]], block_size: int,
                           token_rows: Sequence[int], positions: Sequence[int]) -> list[int]:
    """``table[r][p // block_size] * block_size + p % block_size`` per token."""
    return [table[r][p // block_size] * block_size + p % block_size
            for r, p in zip(token_rows, positions, strict=True)]


def reference_slot_mapping_padded(table: Sequence[Sequence[int]], block_size: int,
                                  token_rows: Sequence[int], positions: Sequence[int],
                                  num_padded: int) -> list[int]:
    """:func:`reference_slot_mapping` followed by :data:`PAD_SLOT_ID` up to
    ``num_padded`` tokens."""
    slots = reference_slot_mapping(table, block_size, token_rows, positions)
    if num_padded < len(slots):
        raise InvalidArgumentError(f"num_padded {num_padded} < {len(slots)} tokens")
    return slots + [PAD_SLOT_ID] * (num_padded - len(slots))


class ReferenceCache:
    """A cache as ``pages[tensor][block] -> bytes`` (see the module docstring)."""

    def __init__(self, pages: list[list[bytes]]) -> None:
        self.pages = pages

    @property
    def num_blocks(self) -> int:
        return len(self.pages[0]) if self.pages else 0


def reference_copy_blocks(cache: ReferenceCache, pairs: Sequence[tuple[int, int]],
                          tensor_ids: Sequence[int]) -> None:
    """In ``cache``, set page ``dst`` to the old page ``src`` for every pair, in
    every tensor of ``tensor_ids``; validate everything first."""
    check_block_pairs(pairs, cache.num_blocks, cache.num_blocks)
    for t in tensor_ids:
        old = list(cache.pages[t])
        for src, dst in pairs:
            cache.pages[t][dst] = old[src]


def reference_swap_blocks(src_cache: ReferenceCache, dst_cache: ReferenceCache,
                          pairs: Sequence[tuple[int, int]]) -> None:
    """Set page ``dst`` of ``dst_cache`` to page ``src`` of ``src_cache`` in
    every tensor; validate everything first."""
    check_block_pairs(pairs, src_cache.num_blocks, dst_cache.num_blocks)
    for t in range(len(src_cache.pages)):
        for src, dst in pairs:
            dst_cache.pages[t][dst] = src_cache.pages[t][src]


def _row_major(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        assert 0 <= i < n, (index, shape)
        flat = flat * n + i
    return flat


def reference_byte_offset(spec: KVCacheSpec, view: str, index: Sequence[int]) -> int:
    """Byte offset, from the start of the layer's tensor, of element ``index``
    of the layer's typed view ``view`` (the block-major layout of
    docs/tensor-path.md: block ``b`` is bytes ``[b * page, (b + 1) * page)``).
    """
    page = spec.page_size_bytes
    if isinstance(spec, MambaSpec):
        i = int(view.removeprefix("state"))
        start = sum(math.prod(shape) * dtype_size(dt)
                    for shape, dt in zip(spec.shapes[:i], spec.dtypes[:i]))
        return index[0] * page + start + _row_major(index[1:], spec.shapes[i]) * dtype_size(
            spec.dtypes[i])
    if isinstance(spec, MLAAttentionSpec):
        assert view == "latent"
        if spec.cache_dtype_str == FP8_DS_MLA:
            return index[0] * page + _row_major(index[1:], (spec.block_size,
                                                            FP8_DS_MLA_BYTES_PER_TOKEN))
        shape = [spec.block_size, spec.head_size]
        if spec.num_kv_heads > 1:
            shape.insert(1, spec.num_kv_heads)
        return index[0] * page + _row_major(index[1:], shape) * dtype_size(spec.dtype)
    assert isinstance(spec, AttentionSpec)
    size = dtype_size(spec.dtype)
    head_v = spec.head_size
    if isinstance(spec, FullAttentionSpec) and spec.head_size_v is not None:
        head_v = spec.head_size_v
    if view == "kv":
        view, index = ("key", "value")[index[0]], index[1:]
    block, token, head, dim = index
    if view == "key":
        inner = _row_major([token, head, dim], [spec.block_size, spec.num_kv_heads, spec.head_size])
        return block * page + inner * size
    assert view == "value"
    k_bytes = spec.block_size * spec.num_kv_heads * spec.head_size * size
    inner = _row_major([token, head, dim], [spec.block_size, spec.num_kv_heads, head_v])
    return block * page + k_bytes + inner * size
