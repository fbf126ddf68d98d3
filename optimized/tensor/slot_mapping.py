"""Slot mapping: where each scheduled token's K/V goes in the paged cache.

Token at position ``p`` of the request in table row ``r`` is written, in group
``g``, to the flat slot ``table_g[r, p // block_size_g] * block_size_g +
p % block_size_g``: block id times block size plus the offset in the block.
Example, block size 4, row ``[7, 2, 9]``::

    position   0 1 2 3 | 4 5 6 7 | 8 9
    block id   7 7 7 7 | 2 2 2 2 | 9 9
    slot      28 ... 31| 8 ... 11|36 37

Everything here is a fixed sequence of torch ops (no Python loop over tokens
or groups, no host sync), identical on CPU and CUDA. Padding tokens of a
fixed-size (graph-captured) batch get :data:`PAD_SLOT_ID`, which the attention
kernels skip.

Each call checks its arguments first (``checks`` module): dtypes, shapes and
devices on the host, then the few value bounds (rows, positions, counts) in
one small device-to-host read, and raises a typed error before any tensor is
written.
"""

from __future__ import annotations

import torch

from pagedkv.optimized.tensor.checks import (
    check_int,
    check_int_tensor,
    check_same_length,
    first_index,
    host_ints,
)
from pagedkv.spec.errors import InvalidArgumentError, InvalidTokenCountError

__all__ = ["NULL_BLOCK_ID", "PAD_SLOT_ID", "token_batch", "slot_mapping_flat",
           "slot_mapping_padded", "slot_mapping_kernel", "check_num_padded", "check_out", "check_token_tensors",
           "check_token_values", "token_stats"]

NULL_BLOCK_ID = 0
"""The null block: placeholder for skipped blocks and unused table entries."""

PAD_SLOT_ID = -1
"""Slot of a padding token."""


def _refuse_negative(name: str, values: torch.Tensor,
                     error: type[InvalidArgumentError] = InvalidArgumentError) -> None:
    i = first_index(values < 0)
    raise error(f"{name}[{i}] is {int(values[i])}, expected >= 0")


def token_batch(rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(token_rows, positions)`` (int64) of a batch where request
    ``i`` sits in table row ``rows[i]`` and schedules ``counts[i]`` tokens
    from position ``starts[i]``; ``num_tokens == counts.sum()`` is passed by
    the caller so that the expansion needs no device-to-host sync.

    Example: ``rows=[3, 0]``, ``starts=[5, 0]``, ``counts=[2, 3]`` gives
    ``token_rows=[3, 3, 0, 0, 0]`` and ``positions=[5, 6, 0, 1, 2]``.

    Cost: O(num_tokens) work in a fixed number of ops, plus the checks' one
    read of four values (skipped during CUDA graph capture).

    Raises:
        InvalidArgumentError: ``rows``, ``starts`` or ``counts`` is not a 1-D
            integer tensor, they differ in length or device, ``num_tokens`` is
            not an int, or a row or start is negative.
        InvalidTokenCountError: a count or ``num_tokens`` is negative, or
            ``num_tokens`` is not ``counts.sum()``.
    """
    rows = check_int_tensor("rows", rows, 1, None)
    starts = check_int_tensor("starts", starts, 1, rows.device, device_of="rows")
    counts = check_int_tensor("counts", counts, 1, rows.device, device_of="rows")
    n = check_same_length(("rows", rows), ("starts", starts), ("counts", counts))
    num_tokens = check_int("num_tokens", num_tokens, 0, InvalidTokenCountError)
    rows, starts, counts = rows.long(), starts.long(), counts.long()
    ends = torch.cumsum(counts, 0)  # one past each request's last token
    values = host_ints([counts.min(), ends[-1], starts.min(), rows.min()]) if n else [0, 0, 0, 0]
    if values is not None:
        min_count, total, min_start, min_row = values
        if min_count < 0:
            _refuse_negative("counts", counts, InvalidTokenCountError)
        if total != num_tokens:
            raise InvalidTokenCountError(
                f"num_tokens is {num_tokens} but counts sum to {total}; expected equal")
        if min_start < 0:
            _refuse_negative("starts", starts)
        if min_row < 0:
            _refuse_negative("rows", rows)
    token_rows = torch.repeat_interleave(rows, counts, output_size=num_tokens)
    offsets = torch.arange(num_tokens, device=counts.device) - torch.repeat_interleave(
        ends - counts, counts, output_size=num_tokens)
    positions = torch.repeat_interleave(starts, counts, output_size=num_tokens) + offsets
    return token_rows, positions


def check_token_tensors(token_rows: object, positions: object,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata checks of a slot mapping's tokens: ``token_rows`` and
    ``positions`` are 1-D integer tensors of one length on ``device`` (the
    table's). Cost: O(1), no sync.

    Raises:
        InvalidArgumentError: one of these does not hold.
    """
    rows = check_int_tensor("token_rows", token_rows, 1, device, device_of="the table")
    pos = check_int_tensor("positions", positions, 1, device, device_of="the table")
    check_same_length(("token_rows", rows), ("positions", pos))
    return rows, pos


def check_out(out: object, num_groups: int, min_width: int, device: torch.device) -> torch.Tensor:
    """``out`` if it is an int64 ``[num_groups, >= min_width]`` tensor on ``device``.

    Raises:
        InvalidArgumentError: it is not.
    """
    out = check_int_tensor("out", out, 2, device, dtype=torch.int64, device_of="the table")
    if out.shape[0] != num_groups or out.shape[1] < min_width:
        raise InvalidArgumentError(
            f"out must have shape [{num_groups}, >= {min_width}] (groups, tokens), "
            f"got {tuple(out.shape)}")
    return out


def token_stats(token_rows: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """The reductions :func:`check_token_values` reads: min and max of the
    rows and of the positions (none for an empty batch)."""
    if token_rows.shape[0] == 0:
        return []
    row_min, row_max = torch.aminmax(token_rows)
    pos_min, pos_max = torch.aminmax(positions)
    return [row_min, row_max, pos_min, pos_max]


def check_token_values(values: list[int], token_rows: torch.Tensor, positions: torch.Tensor,
                       num_rows: int, position_limit: int, limit_reason: str) -> None:
    """Refuse a batch whose rows are outside ``[0, num_rows)`` or whose
    positions are outside ``[0, position_limit)``; ``values`` are
    :func:`token_stats` read on the host (empty: nothing to check).

    Raises:
        InvalidArgumentError: a row or position out of range, naming the first.
    """
    if not values:
        return
    row_min, row_max, pos_min, pos_max = values
    if row_min < 0 or row_max >= num_rows:
        i = first_index((token_rows < 0) | (token_rows >= num_rows))
        raise InvalidArgumentError(
            f"token_rows[{i}] is {int(token_rows[i])}, outside the table's rows [0, {num_rows})")
    if pos_min < 0 or pos_max >= position_limit:
        i = first_index((positions < 0) | (positions >= position_limit))
        raise InvalidArgumentError(
            f"positions[{i}] is {int(positions[i])}, outside [0, {position_limit}) "
            f"({limit_reason})")


def slot_mapping_flat(table: torch.Tensor, offsets: torch.Tensor, block_sizes: torch.Tensor,
                      token_rows: torch.Tensor, positions: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Slots ``[num_groups, num_tokens]`` (int64) for every group at once.

    ``table`` is the integer (int32) matrix ``[max_num_reqs, width]`` holding
    every group's table side by side; ``offsets`` and ``block_sizes`` are
    integer ``[num_groups, 1]`` (group ``g``'s first column and block size;
    the groups' columns in order, each at least one wide). A position must be
    below ``width_g * block_size_g`` in every group; past the row's blocks it
    lands in the null block (see ``BlockTables.check_batch``). With ``out``
    given (int64, ``[num_groups, >= num_tokens]``) the result is written into
    ``out[:, :num_tokens]`` and that view is returned.

    Cost: about six device ops, independent of the number of tokens and
    groups, plus the checks' one read of a few values.

    Raises:
        InvalidArgumentError: a tensor of the wrong type, dtype, shape or
            device; a group layout that does not fit ``table`` (an offset out
            of order or past it, a block size below 1); a token row outside
            the table; a position negative or past a group's width.
    """
    return slot_mapping_kernel(*_check_flat(table, offsets, block_sizes, token_rows, positions, out))


def _check_flat(table: object, offsets: object, block_sizes: object, token_rows: object,
                positions: object, out: object
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor | None]:
    """The checks of :func:`slot_mapping_flat`; its arguments, checked."""
    table = check_int_tensor("table", table, 2, None)
    device = table.device
    offsets = check_int_tensor("offsets", offsets, 2, device, device_of="table")
    block_sizes = check_int_tensor("block_sizes", block_sizes, 2, device, device_of="table")
    num_groups = offsets.shape[0]
    if num_groups == 0 or offsets.shape != (num_groups, 1) or block_sizes.shape != offsets.shape:
        raise InvalidArgumentError(
            f"offsets and block_sizes must both have shape [num_groups >= 1, 1], got "
            f"{tuple(offsets.shape)} and {tuple(block_sizes.shape)}")
    rows, pos = check_token_tensors(token_rows, positions, device)
    checked_out = None if out is None else check_out(out, num_groups, pos.shape[0], device)
    # Group g's columns are [offsets[g], offsets[g + 1]), the last ending at the table's width.
    ends = torch.cat((offsets[1:, 0], offsets.new_full((1,), table.shape[1])))
    widths = ends - offsets[:, 0]
    values = host_ints([offsets.min(), widths.min(), block_sizes.min(),
                        (widths * block_sizes[:, 0]).min(), *token_stats(rows, pos)])
    if values is not None:
        first_offset, min_width, min_block_size, limit = values[:4]
        if first_offset < 0 or min_width < 1:
            raise InvalidArgumentError(
                f"offsets {offsets.view(-1).tolist()} must increase from >= 0 and stay below the "
                f"table's width {table.shape[1]}")
        if min_block_size < 1:
            raise InvalidArgumentError(
                f"block_sizes {block_sizes.view(-1).tolist()} must all be >= 1")
        check_token_values(values[4:], rows, pos, table.shape[0], limit,
                           "the narrowest group's width times its block size")
    return table, offsets, block_sizes, rows, pos, checked_out


def slot_mapping_kernel(table: torch.Tensor, offsets: torch.Tensor, block_sizes: torch.Tensor,
           token_rows: torch.Tensor, positions: torch.Tensor,
           out: torch.Tensor | None) -> torch.Tensor:
    """:func:`slot_mapping_flat` without its checks: for arguments already
    checked (``BlockTables`` checks its tokens against bounds it knows)."""
    pos = positions.long().view(1, -1)
    block_index = torch.div(pos, block_sizes, rounding_mode="floor")  # [G, T]
    flat_index = token_rows.long().view(1, -1) * table.stride(0) + offsets + block_index
    block_ids = table.reshape(-1).index_select(0, flat_index.view(-1)).view_as(block_index)
    slots = block_ids.long() * block_sizes + (pos - block_index * block_sizes)
    if out is None:
        return slots
    view = out[:, :slots.shape[1]]
    view.copy_(slots)
    return view


def check_num_padded(num_padded: object, num_tokens: int, out: torch.Tensor) -> int:
    """``num_padded`` if it is an int in ``[num_tokens, out.shape[1]]``.

    Raises:
        InvalidArgumentError: it is not.
    """
    if isinstance(num_padded, bool) or not isinstance(num_padded, int) or not (
            num_tokens <= num_padded <= out.shape[1]):
        raise InvalidArgumentError(
            f"num_padded must be an int in [{num_tokens}, {out.shape[1]}] (the number of tokens, "
            f"the width of out), got {num_padded!r}")
    return num_padded


def slot_mapping_padded(table: torch.Tensor, offsets: torch.Tensor, block_sizes: torch.Tensor,
                        token_rows: torch.Tensor, positions: torch.Tensor,
                        out: torch.Tensor, num_padded: int) -> torch.Tensor:
    """:func:`slot_mapping_flat` into the persistent buffer ``out`` (int64,
    ``[num_groups, >= num_padded]``), with tokens ``[num_tokens, num_padded)``
    set to :data:`PAD_SLOT_ID`; returns ``out[:, :num_padded]``, whose address
    never changes (safe to capture in a CUDA graph).

    Cost: :func:`slot_mapping_flat` plus one fill.

    Raises:
        InvalidArgumentError: see :func:`slot_mapping_flat`; ``out`` is not
            given, or ``num_padded`` is not an int, is below the number of
            tokens or above the buffer's width.
    """
    if out is None:
        raise InvalidArgumentError("out must be a torch.Tensor, got None")
    args = _check_flat(table, offsets, block_sizes, token_rows, positions, out)
    num_tokens = args[4].shape[0]
    check_num_padded(num_padded, num_tokens, out)
    slot_mapping_kernel(*args)
    out[:, num_tokens:num_padded].fill_(PAD_SLOT_ID)
    return out[:, :num_padded]
