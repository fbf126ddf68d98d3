"""Block tables of every KV cache group, on the device, updated incrementally.

Model (the same as ``pagedkv.reference.features.tensor_model.ReferenceBlockTables``):
each group ``g`` has a table of ``max_num_reqs`` rows and
``max_blocks_per_req[g]`` columns. A row is free or holds one request's block
ids for the group, in block order; skipped blocks are the null block ``0``; every
entry past a row's length is ``0``, so a read past the end lands in the null
block instead of another request's KV.

Layout: all groups live in one int32 matrix ``[max_num_reqs, sum(widths)]``;
group ``g`` is the column range ``[offset_g, offset_g + width_g)``, so
:meth:`BlockTables.table` is a view ``[max_num_reqs, width_g]`` with unit
column stride (contiguous when there is one group). Updates go to a host copy
(pinned when the device is CUDA) through numpy; :meth:`BlockTables.commit`
sends rows ``[0, n)`` of every group to the device in **one** transfer.

Engine cycle per step: ``add_request`` / ``append_blocks`` / ``set_null`` /
``remove_request`` / ``condense`` from the scheduler's results, then ``commit``,
then ``slot_mapping`` and the model forward reading ``table(g)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.optimized.tensor.checks import check_device, check_pin_memory, host_ints, int_array
from pagedkv.optimized.tensor.slot_mapping import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    check_num_padded,
    check_out,
    check_token_tensors,
    check_token_values,
    slot_mapping_kernel,
    token_stats,
)
from pagedkv.spec.errors import InvalidArgumentError, UnknownBlockError

__all__ = ["BlockTables"]


class BlockTables:
    """One int32 block table per KV cache group, on ``device``.

    ``block_sizes[g]`` and ``max_blocks_per_req[g]`` describe group ``g``;
    ``num_blocks`` bounds the block ids accepted (``[0, num_blocks)``).
    """

    def __init__(self, block_sizes: Sequence[int], max_num_reqs: int,
                 max_blocks_per_req: Sequence[int], num_blocks: int,
                 device: torch.device | str = "cpu", pin_memory: bool | None = None) -> None:
        """Allocate the tables, all rows free.

        ``pin_memory`` defaults to "the device is CUDA".

        Cost: O(max_num_reqs * sum(max_blocks_per_req)) memory, host and device.

        Raises:
            InvalidArgumentError: sizes are not positive ints, the group
                lists are not lists or differ in length, ``device`` is not a
                device present here, ``pin_memory`` is not a bool or is
                ``True`` without CUDA.
        """
        given: tuple[tuple[str, object], ...] = (("block_sizes", block_sizes),
                                                 ("max_blocks_per_req", max_blocks_per_req))
        for name, sizes in given:
            if not isinstance(sizes, Sequence) or isinstance(sizes, str):
                raise InvalidArgumentError(f"{name} must be a sequence of ints (one per group), "
                                           f"got {sizes!r}")
        if not block_sizes or len(block_sizes) != len(max_blocks_per_req):
            raise InvalidArgumentError(
                f"need one block size and one max_blocks_per_req per group, got "
                f"{list(block_sizes)!r} and {list(max_blocks_per_req)!r}")
        for name, value in [("max_num_reqs", max_num_reqs), ("num_blocks", num_blocks),
                            *[("block_sizes", b) for b in block_sizes],
                            *[("max_blocks_per_req", m) for m in max_blocks_per_req]]:
            if type(value) is not int or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.device = check_device("device", device)
        pin_memory = (self.device.type == "cuda" if pin_memory is None
                      else check_pin_memory("pin_memory", pin_memory))
        self.block_sizes = tuple(block_sizes)
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = tuple(max_blocks_per_req)
        self.num_blocks = num_blocks
        self.num_groups = len(block_sizes)
        offsets = np.concatenate([[0], np.cumsum(self.max_blocks_per_req)])
        self._offsets: tuple[int, ...] = tuple(int(o) for o in offsets)
        self.width = self._offsets[-1]
        # A position must stay within every group's columns: below the
        # narrowest width_g * block_size_g (the slot mapping's one bound).
        narrowest = min(range(self.num_groups),
                        key=lambda g: self.max_blocks_per_req[g] * self.block_sizes[g])
        self._position_limit = self.max_blocks_per_req[narrowest] * self.block_sizes[narrowest]
        self._limit_reason = (f"group {narrowest}: max_blocks_per_req "
                              f"{self.max_blocks_per_req[narrowest]} * block size "
                              f"{self.block_sizes[narrowest]}")
        self._host = torch.zeros((max_num_reqs, self.width), dtype=torch.int32,
                                 pin_memory=pin_memory)
        self._host_np: npt.NDArray[np.int32] = self._host.numpy()
        self._device_table = torch.zeros((max_num_reqs, self.width), dtype=torch.int32,
                                         device=self.device)
        self._lengths: npt.NDArray[np.int64] = np.zeros(
            (self.num_groups, max_num_reqs), dtype=np.int64)
        self._occupied: npt.NDArray[np.bool_] = np.zeros(max_num_reqs, dtype=np.bool_)
        # Rows [0, _dirty_rows) may differ between host and device.
        self._dirty_rows = 0
        # The last async host->device copy; the host copy is not touched until it is done.
        self._transfer_done: torch.cuda.Event | None = None
        self._block_sizes_dev = torch.tensor(self.block_sizes, dtype=torch.int64,
                                             device=self.device).view(-1, 1)
        self._offsets_dev = torch.tensor(self._offsets[:-1], dtype=torch.int64,
                                         device=self.device).view(-1, 1)

    # -- queries -------------------------------------------------------------

    def table(self, group_id: int) -> torch.Tensor:
        """The device table of ``group_id``: int32 ``[max_num_reqs, width_g]``.

        A view of the shared matrix (row stride ``self.width``); it reflects
        the updates of the last :meth:`commit`. Cost: O(1).

        Raises:
            InvalidArgumentError: ``group_id`` is not a group.
        """
        g = self._group(group_id)
        start, stop = self._offsets[g], self._offsets[g + 1]
        return self._device_table[:, start:stop]

    def host_table(self, group_id: int) -> npt.NDArray[np.int32]:
        """The host (staging) table of ``group_id``, as a numpy view: what the
        device table will hold after the next :meth:`commit`. Cost: O(1).

        Raises:
            InvalidArgumentError: ``group_id`` is not a group.
        """
        g = self._group(group_id)
        start, stop = self._offsets[g], self._offsets[g + 1]
        return self._host_np[:, start:stop]

    def is_occupied(self, row: int) -> bool:
        """Whether ``row`` holds a request. Cost: O(1).

        Raises:
            InvalidArgumentError: ``row`` is out of range.
        """
        return bool(self._occupied[self._row(row)])

    def num_blocks_in_row(self, row: int, group_id: int) -> int:
        """How many blocks of ``group_id`` the request in ``row`` has. Cost: O(1).

        Raises:
            InvalidArgumentError: ``row`` or ``group_id`` is out of range.
        """
        return int(self._lengths[self._group(group_id), self._row(row)])

    @property
    def num_occupied(self) -> int:
        """Rows holding a request. Cost: O(max_num_reqs)."""
        return int(self._occupied.sum())

    # -- updates (host side) ---------------------------------------------------

    def add_request(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """Put a new request in the free ``row`` with ``block_ids[g]`` for each
        group (``KVCacheManager.get_block_ids(req_id)``).

        Cost: O(blocks given).

        Raises:
            InvalidArgumentError: the row is out of range or occupied, the
                number of groups is wrong, or a row would exceed its width.
            UnknownBlockError: a block id is outside ``[0, num_blocks)``.
        """
        r = self._row(row)
        if self._occupied[r]:
            raise InvalidArgumentError(f"row {r} is already occupied")
        arrays = self._checked_ids(r, block_ids, append=False)
        self._before_write(r)
        self._occupied[r] = True
        self._write(r, arrays)

    def append_blocks(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """Append ``block_ids[g]`` to the request in ``row`` for each group:
        the new blocks of one ``allocate_slots`` (``KVCacheBlocks.get_block_ids()``).

        Cost: O(blocks given).

        Raises:
            InvalidArgumentError: the row is out of range or free, the number
                of groups is wrong, or a row would exceed its width.
            UnknownBlockError: a block id is outside ``[0, num_blocks)``.
        """
        r = self._row(row)
        if not self._occupied[r]:
            raise InvalidArgumentError(f"row {r} is free")
        arrays = self._checked_ids(r, block_ids, append=True)
        self._before_write(r)
        self._write(r, arrays)

    def set_null(self, row: int, group_id: int, start: int, stop: int) -> None:
        """Replace blocks ``[start, stop)`` of the request in ``row`` by the
        null block in group ``group_id`` (blocks the manager skipped: sliding
        window, chunked local attention).

        Cost: O(stop - start).

        Raises:
            InvalidArgumentError: row free or out of range, group out of range,
                or the range is not within the row's blocks.
        """
        r = self._row(row)
        if not self._occupied[r]:
            raise InvalidArgumentError(f"row {r} is free")
        self._group(group_id)
        length = int(self._lengths[group_id, r])
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop <= length:
            raise InvalidArgumentError(
                f"start, stop [{start!r}, {stop!r}) must be ints within the row's {length} blocks")
        self._before_write(r)
        base = self._offsets[group_id]
        self._host_np[r, base + start:base + stop] = NULL_BLOCK_ID

    def remove_request(self, row: int) -> None:
        """Free ``row``: its entries become the null block.

        Cost: O(blocks in the row).

        Raises:
            InvalidArgumentError: the row is out of range or already free.
        """
        r = self._row(row)
        if not self._occupied[r]:
            raise InvalidArgumentError(f"row {r} is free")
        self._before_write(r)
        self._clear(r)

    def move_row(self, src: int, dst: int) -> None:
        """Move the request in ``src`` to the free row ``dst``; ``src`` becomes free.

        Cost: O(blocks in the row).

        Raises:
            InvalidArgumentError: a row is out of range, ``src`` is free or
                ``dst`` is occupied.
        """
        s, d = self._row(src), self._row(dst)
        if not self._occupied[s]:
            raise InvalidArgumentError(f"source row {s} is free")
        if self._occupied[d]:
            raise InvalidArgumentError(f"destination row {d} is occupied")
        self._before_write(max(s, d))
        # dst is free, hence all null: copying the used prefix of each group suffices.
        for g in range(self.num_groups):
            base, n = self._offsets[g], int(self._lengths[g, s])
            self._host_np[d, base:base + n] = self._host_np[s, base:base + n]
            self._lengths[g, d] = n
        self._occupied[d] = True
        self._clear(s)

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (either may be free).

        Cost: O(sum of widths).

        Raises:
            InvalidArgumentError: a row is out of range.
        """
        ra, rb = self._row(a), self._row(b)
        self._before_write(max(ra, rb))
        self._host_np[[ra, rb]] = self._host_np[[rb, ra]]
        self._lengths[:, [ra, rb]] = self._lengths[:, [rb, ra]]
        self._occupied[[ra, rb]] = self._occupied[[rb, ra]]

    def condense(self) -> list[tuple[int, int]]:
        """Move the last occupied rows into the first free rows until the
        occupied rows are exactly ``0 .. n-1``.

        Returns the moves ``(src, dst)`` in the order done, so the engine can
        move its own per-row state the same way.

        Cost: O(max_num_reqs + blocks moved).
        """
        moves: list[tuple[int, int]] = []
        free = np.flatnonzero(~self._occupied)
        used = np.flatnonzero(self._occupied)
        # Pair the lowest free rows with the highest used rows while free < used.
        for dst, src in zip(free.tolist(), used[::-1].tolist()):
            if dst > src:
                break
            self.move_row(src, dst)
            moves.append((src, dst))
        return moves

    # -- transfer ----------------------------------------------------------------

    def commit(self) -> None:
        """Send every update since the last commit to the device, all groups
        in one transfer (asynchronous from pinned memory on CUDA).

        Cost: one copy of rows ``[0, highest row changed]``.
        """
        n = self._dirty_rows
        if n == 0:
            return
        non_blocking = self._host.is_pinned() and self.device.type == "cuda"
        self._device_table[:n].copy_(self._host[:n], non_blocking=non_blocking)
        if non_blocking:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._transfer_done = event
        self._dirty_rows = 0

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Flat slots ``[num_groups, num_tokens]`` (int64) for tokens at
        ``positions`` of the requests in ``token_rows`` (1-D integer tensors
        on the table's device), read from the device tables (commit first).
        See :func:`slot_mapping_flat`; with ``out`` (int64 ``[num_groups, >=
        num_tokens]``) the slots are written into ``out[:, :num_tokens]``.

        Cost: a fixed handful of device ops, independent of the batch size,
        plus the checks' one read of four values (min and max of the rows
        and positions).

        Raises:
            InvalidArgumentError: a tensor of the wrong type, dtype, shape or
                device; a row outside ``[0, max_num_reqs)``; a position
                negative or at least ``max_blocks_per_req[g] * block_sizes[g]``
                in some group (it would read another group's or row's
                entries). A free row, or a position past the row's blocks,
                reads the null block (see :meth:`check_batch`).
        """
        rows, pos = self._check_tokens(token_rows, positions)
        checked_out = None if out is None else check_out(
            out, self.num_groups, pos.shape[0], self._device_table.device)
        self._check_token_values(rows, pos)
        return slot_mapping_kernel(self._device_table, self._offsets_dev, self._block_sizes_dev,
                                   rows, pos, checked_out)

    def slot_mapping_padded(self, token_rows: torch.Tensor, positions: torch.Tensor,
                            out: torch.Tensor, num_padded: int) -> torch.Tensor:
        """Like :meth:`slot_mapping`, written into the persistent int64 buffer
        ``out`` (``[num_groups, >= num_padded]``) with the padding tokens set to
        ``PAD_SLOT_ID``; returns ``out[:, :num_padded]``. See
        :func:`slot_mapping_padded`.

        Raises:
            InvalidArgumentError: see :meth:`slot_mapping`; ``num_padded`` not
                an int, below the number of tokens or above the width of ``out``.
        """
        rows, pos = self._check_tokens(token_rows, positions)
        checked_out = check_out(out, self.num_groups, pos.shape[0], self._device_table.device)
        num_tokens = pos.shape[0]
        check_num_padded(num_padded, num_tokens, checked_out)
        self._check_token_values(rows, pos)
        slot_mapping_kernel(self._device_table, self._offsets_dev, self._block_sizes_dev,
                            rows, pos, checked_out)
        checked_out[:, num_tokens:num_padded].fill_(PAD_SLOT_ID)
        return checked_out[:, :num_padded]

    def check_batch(self, token_rows: Sequence[int], positions: Sequence[int]) -> None:
        """Raise unless every token falls within its row's blocks in every group
        (a host-side check for debugging and tests; the hot path does none).

        Raises:
            InvalidArgumentError: not lists (or arrays, or tensors) of ints
                of one length, a row out of range or free, or a position
                negative or past its row's blocks.
        """
        rows = int_array("token_rows", token_rows)
        pos = int_array("positions", positions)
        if rows.shape != pos.shape:
            raise InvalidArgumentError(
                f"positions has {pos.size} entries, token_rows has {rows.size}; expected equal lengths")
        if rows.size == 0:
            return
        if rows.min() < 0 or rows.max() >= self.max_num_reqs or not self._occupied[rows].all():
            i = int(np.argmax((rows < 0) | (rows >= self.max_num_reqs)
                              | ~self._occupied[np.clip(rows, 0, self.max_num_reqs - 1)]))
            raise InvalidArgumentError(
                f"token_rows[{i}] is {rows[i]}: out of range [0, {self.max_num_reqs}) or free")
        if pos.min() < 0:
            i = int(np.argmax(pos < 0))
            raise InvalidArgumentError(f"positions[{i}] is {pos[i]}, expected >= 0")
        for g, bs in enumerate(self.block_sizes):
            past = pos // bs >= self._lengths[g, rows]
            if past.any():
                i = int(np.argmax(past))
                raise InvalidArgumentError(
                    f"positions[{i}] is {pos[i]}, past the {self._lengths[g, rows[i]]} blocks of "
                    f"row {rows[i]} in group {g}")

    def check_invariants(self) -> None:
        """Assert the table invariants: free rows are all null, every entry past
        a row's length is null, ids are in range. O(table size)."""
        for g in range(self.num_groups):
            host = self.host_table(g)
            cols = np.arange(host.shape[1])
            past_end = cols[None, :] >= self._lengths[g][:, None]
            assert not host[past_end].any(), f"group {g}: non-null entry past a row's end"
            assert not self._lengths[g][~self._occupied].any(), f"group {g}: free row with blocks"
            assert host.min(initial=0) >= 0 and host.max(initial=0) < self.num_blocks

    # -- helpers -------------------------------------------------------------------

    def _group(self, group_id: object) -> int:
        if type(group_id) is not int or not 0 <= group_id < self.num_groups:
            raise InvalidArgumentError(f"group_id {group_id!r} outside [0, {self.num_groups})")
        return group_id

    def _check_tokens(self, token_rows: object, positions: object
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return check_token_tensors(token_rows, positions, self._device_table.device)

    def _check_token_values(self, rows: torch.Tensor, pos: torch.Tensor) -> None:
        values = host_ints(token_stats(rows, pos))
        if values is not None:
            check_token_values(values, rows, pos, self.max_num_reqs, self._position_limit,
                               self._limit_reason)

    def _row(self, row: object) -> int:
        if type(row) is not int or not 0 <= row < self.max_num_reqs:
            raise InvalidArgumentError(f"row {row!r} outside [0, {self.max_num_reqs})")
        return row

    def _checked_ids(self, row: int, block_ids: Sequence[Sequence[int]],
                     append: bool) -> list[npt.NDArray[np.int64]]:
        given: object = block_ids
        if not isinstance(given, Sequence) or isinstance(given, str):
            raise InvalidArgumentError(
                f"block_ids must be one list of ints per group, got {block_ids!r}")
        if len(block_ids) != self.num_groups:
            raise InvalidArgumentError(
                f"block_ids must have one list per group ({self.num_groups}), got {len(block_ids)}")
        arrays: list[npt.NDArray[np.int64]] = []
        for g, ids in enumerate(block_ids):
            try:
                arr = np.asarray(ids)
            except (TypeError, ValueError):  # ragged or not array-like
                arr = np.asarray(None)
            if arr.size == 0 and arr.ndim == 1:
                arr = np.zeros(0, dtype=np.int64)
            elif arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"block_ids[{g}] must be a list of ints, got {ids!r}")
            elif arr.min() < 0 or arr.max() >= self.num_blocks:
                bad = arr[(arr < 0) | (arr >= self.num_blocks)][0]
                raise UnknownBlockError(
                    f"block_ids[{g}]: block id {bad} outside [0, {self.num_blocks})")
            total = (int(self._lengths[g, row]) if append else 0) + arr.size
            if total > self.max_blocks_per_req[g]:
                raise InvalidArgumentError(
                    f"block_ids[{g}]: {total} blocks exceed max_blocks_per_req[{g}] "
                    f"{self.max_blocks_per_req[g]}")
            arrays.append(arr.astype(np.int64, copy=False))
        return arrays

    def _write(self, row: int, arrays: list[npt.NDArray[np.int64]]) -> None:
        for g, arr in enumerate(arrays):
            start = self._offsets[g] + int(self._lengths[g, row])
            self._host_np[row, start:start + arr.size] = arr
            self._lengths[g, row] += arr.size

    def _clear(self, row: int) -> None:
        for g in range(self.num_groups):
            base = self._offsets[g]
            self._host_np[row, base:base + int(self._lengths[g, row])] = NULL_BLOCK_ID
        self._lengths[:, row] = 0
        self._occupied[row] = False

    def _before_write(self, row: int) -> None:
        # Never write the pinned host copy while an async copy may still read it.
        if self._transfer_done is not None:
            self._transfer_done.synchronize()
            self._transfer_done = None
        self._dirty_rows = max(self._dirty_rows, row + 1)

