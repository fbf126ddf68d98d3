"""The GPU tensor path of pagedkv, in torch (install the ``torch`` extra).

What an engine needs next to the block manager, on CPU or CUDA alike,
selected by a ``device`` argument:

- :class:`KVCacheMemory`: the buffers of a ``KVCacheConfig`` and each layer's
  typed views (block-major layout, see ``memory``);
- :class:`BlockTables`: one int32 block table per KV cache group, updated
  incrementally from the manager's block ids, one transfer per step;
- :func:`token_batch`, ``BlockTables.slot_mapping``: where each token's K/V goes;
- :func:`copy_blocks`, :func:`swap_blocks`: batched block copy and swap.

Every call checks its arguments before it writes a tensor and refuses a bad
one with a typed error from ``pagedkv.spec.errors`` naming the argument
(``checks`` module; docs/tensor-path.md, "Errors").

Import it explicitly (``import pagedkv.optimized.tensor``); the rest of
pagedkv never imports torch. The plain-Python model these are tested against
is ``pagedkv.reference.features.tensor_model``; the layouts and an engine-side example
are in docs/tensor-path.md.
"""

from pagedkv.optimized.tensor.block_ops import BlockPairs, check_block_pairs, copy_blocks, swap_blocks
from pagedkv.optimized.tensor.block_table import BlockTables
from pagedkv.optimized.tensor.memory import (
    TORCH_DTYPES,
    Arena,
    KVCacheMemory,
    LayerCache,
    ViewLayout,
    page_layout,
)
from pagedkv.optimized.tensor.slot_mapping import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    slot_mapping_flat,
    slot_mapping_padded,
    token_batch,
)

__all__ = [
    "Arena",
    "BlockPairs",
    "BlockTables",
    "KVCacheMemory",
    "LayerCache",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "TORCH_DTYPES",
    "ViewLayout",
    "check_block_pairs",
    "copy_blocks",
    "page_layout",
    "slot_mapping_flat",
    "slot_mapping_padded",
    "swap_blocks",
    "token_batch",
]
