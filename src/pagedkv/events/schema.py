"""vLLM 0.33's KV event classes as msgspec structs: the wire schema.

msgspec's bytes depend on more than the fields written: a struct with more
than 15 fields gets a 16-bit map header even when omit_defaults leaves
fewer, and the tag comes first. So the schema is declared the way vLLM
declares it (``vllm/distributed/kv_events.py``), field for field, and
encoding these structs gives vLLM's bytes by construction;
tests/test_events_wire.py compares them with vLLM's own encoder.

- ``KVEventBatch``: array-like ``[ts, events, data_parallel_rank]``;
- events: tagged maps (``"type"`` = the class name), required fields
  always written, defaulted ones only when set.

Imported only when encoding (it needs msgspec, ``pagedkv[events]``).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"]


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV cache event: a map tagged ``"type": <class name>``."""


class BlockStored(_Event):
    """Blocks entered the prefix cache (fields and order as vLLM 0.33)."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_Event):
    """Blocks left the prefix cache."""

    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    """The prefix cache was reset."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
