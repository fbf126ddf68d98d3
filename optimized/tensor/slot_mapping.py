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
"""

from __future__ import annotations

import torch

from pagedkv.spec.errors import InvalidArgumentError

__all__ = ["NULL_BLOCK_ID", "PAD_SLOT_ID", "token_batch", "slot_mapping_flat",
           "slot_mapping_padded"]

NULL_BLOCK_ID = 0
"""The null block: placeholder for skipped blocks and unused table entries."""

PAD_SLOT_ID = -1
"""Slot of a padding token."""


def token_batch(rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(token_rows, positions)`` (int64) of a batch where request
    ``i`` sits in table row ``rows[i]`` and schedules ``counts[i]`` tokens
    from position ``starts[i]``; ``num_tokens == counts.sum()`` is passed by
    the caller so that no device-to-host sync is needed.

    Example: ``rows=[3, 0]``, ``starts=[5, 0]``, ``counts=[2, 3]`` gives
    ``token_rows=[3, 3, 0, 0, 0]`` and ``positions=[5, 6, 0, 1, 2]``.

    Cost: O(num_tokens) work in a fixed number of ops.
    """
    rows, starts, counts = rows.long(), starts.long(), counts.long()
    token_rows = torch.repeat_interleave(rows, counts, output_size=num_tokens)
    first_token = torch.cumsum(counts, 0) - counts  # index of each request's first token
    offsets = torch.arange(num_tokens, device=counts.device) - torch.repeat_interleave(
        first_token, counts, output_size=num_tokens)
    positions = torch.repeat_interleave(starts, counts, output_size=num_tokens) + offsets
    return token_rows, positions


def slot_mapping_flat(table: torch.Tensor, offsets: torch.Tensor, block_sizes: torch.Tensor,
                      token_rows: torch.Tensor, positions: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Slots ``[num_groups, num_tokens]`` (int64) for every group at once.

    ``table`` is the int32 matrix ``[max_num_reqs, width]`` holding every
    group's table side by side; ``offsets`` and ``block_sizes`` are int64
    ``[num_groups, 1]`` (group ``g``'s first column and block size). A position
    must be below ``width_g * block_size_g``; past the row's blocks it lands
    in the null block (see ``BlockTables.check_batch``). With ``out`` given
    (int64, ``[num_groups, >= num_tokens]``) the result is written into
    ``out[:, :num_tokens]`` and that view is returned.

    Cost: about six device ops, independent of the number of tokens and groups.
    """
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


def slot_mapping_padded(table: torch.Tensor, offsets: torch.Tensor, block_sizes: torch.Tensor,
                        token_rows: torch.Tensor, positions: torch.Tensor,
                        out: torch.Tensor, num_padded: int) -> torch.Tensor:
    """:func:`slot_mapping_flat` into the persistent buffer ``out`` (int64,
    ``[num_groups, >= num_padded]``), with tokens ``[num_tokens, num_padded)``
    set to :data:`PAD_SLOT_ID`; returns ``out[:, :num_padded]``, whose address
    never changes (safe to capture in a CUDA graph).

    Cost: :func:`slot_mapping_flat` plus one fill.

    Raises:
        InvalidArgumentError: ``num_padded`` is below the number of tokens or
            above the buffer's width.
    """
    num_tokens = positions.shape[0]
    if not num_tokens <= num_padded <= out.shape[1]:
        raise InvalidArgumentError(
            f"num_padded must be in [{num_tokens}, {out.shape[1]}], got {num_padded}")
    slot_mapping_flat(table, offsets, block_sizes, token_rows, positions, out=out)
    out[:, num_tokens:num_padded].fill_(PAD_SLOT_ID)
    return out[:, :num_padded]
