"""pagedkv's KV cache events in vLLM 0.33's wire format.

vLLM publishes each scheduler step's events as one ``KVEventBatch``,
msgpack-encoded: the batch is an **array** ``[ts, events,
data_parallel_rank]``; each event is a **map** whose first key ``"type"``
names its class (``"BlockStored"``, ``"BlockRemoved"``,
``"AllBlocksCleared"``), followed by the class's fields in declaration
order. Fields without a default are always written (``None`` as nil);
fields with a default are left out while they hold it. Routers (NVIDIA
Dynamo's KV indexer, llm-d's prefix-cache scorer) decode exactly this, so
the field names, their order and which ones are omitted are part of the
contract: tests/test_events_wire.py pins them, against vLLM's own encoder
where vLLM is installed.

Block hashes go out as integers, the low 64 bits of pagedkv's hash read
big-endian, as vLLM does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
(Dynamo rejects byte-string hashes); ``hashes="bytes"`` sends the raw
digests as stock vLLM does without that option.

This module turns :mod:`pagedkv.spec.types` events into the structs of
:mod:`pagedkv.events.schema` and encodes them with msgspec, as vLLM does
(``pip install 'pagedkv[events]'``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from pagedkv.spec.config import KVCacheConfig
from pagedkv.spec.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["HASH_MASK", "END_SEQ", "HashForm", "GroupMetadata", "WireOptions", "DEFAULT_OPTIONS", "external_hash",
           "event_to_wire", "batch_to_wire", "encode_batch", "decode_batch", "group_metadata",
           "missing_dependency"]

HASH_MASK: Final = (1 << 64) - 1
"""The integer hash is the digest's low 64 bits (read big-endian)."""

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that closes a replay (eight 0xff bytes)."""

HashForm = Literal["int", "bytes"]


def missing_dependency(module: str) -> ImportError:
    """The error raised when an optional dependency of the publisher is absent."""
    return ImportError(f"pagedkv.events needs {module}: pip install 'pagedkv[events]' (pyzmq and msgspec)")


def external_hash(block_hash: bytes, form: HashForm = "int") -> int | bytes:
    """A block hash as it goes on the wire: the low 64 bits as an unsigned
    int (``form="int"``) or the digest itself (``"bytes"``)."""
    if form == "int":
        return int.from_bytes(block_hash, "big") & HASH_MASK
    return bytes(block_hash)


@dataclass(frozen=True, slots=True)
class GroupMetadata:
    """What vLLM 0.33 puts on each ``BlockStored`` of a KV cache group:
    the kind of its spec (``"full_attention"``, ``"sliding_window"``...)
    and, for sliding windows, the window in tokens."""

    kind: str
    sliding_window: int | None = None


# pagedkv.spec's class names -> vLLM 0.33's KVCacheSpecKind values. Subclasses
# come first (MLA and sink are full attention too), as in vLLM's lookup.
_KINDS: Final[tuple[tuple[str, str], ...]] = (
    ("SlidingWindowMLASpec", "sliding_window_mla"), ("MLAAttentionSpec", "mla_attention"),
    ("SinkFullAttentionSpec", "sink_full_attention"), ("FullAttentionSpec", "full_attention"),
    ("ChunkedLocalAttentionSpec", "chunked_local_attention"), ("SlidingWindowSpec", "sliding_window"),
    ("MambaSpec", "mamba"), ("EncoderOnlyAttentionSpec", "encoder_only_attention"),
    ("CrossAttentionSpec", "cross_attention"),
)


def _spec_metadata(spec: Any) -> GroupMetadata:
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:  # a uniform-type group: one kind if all agree
        parts = {_spec_metadata(member) for member in inner.values()}
        windows = {part.sliding_window for part in parts}
        kinds = {part.kind for part in parts}
        return GroupMetadata(kinds.pop() if len(kinds) == 1 else "unknown",
                             windows.pop() if len(windows) == 1 else None)
    lineage = {cls.__name__ for cls in type(spec).__mro__}
    for name, kind in _KINDS:
        if name in lineage:
            window = getattr(spec, "sliding_window", None) if "SlidingWindowSpec" in lineage else None
            return GroupMetadata(kind, window)
    return GroupMetadata("unknown")


def group_metadata(config: KVCacheConfig) -> tuple[GroupMetadata, ...]:
    """Each group's :class:`GroupMetadata` for a manager built on ``config``."""
    return tuple(_spec_metadata(group.kv_cache_spec) for group in config.kv_cache_groups)


@dataclass(frozen=True, slots=True)
class WireOptions:
    """How events are written.

    ``groups`` annotates each ``BlockStored`` with its group's kind and
    window (empty: no annotation, as a bare vLLM block pool). A
    ``BlockRemoved`` carries the group of the key it dropped, as vLLM
    0.33's block pool does (D-EVT-12).
    """

    hashes: HashForm = "int"
    groups: tuple[GroupMetadata, ...] = ()


DEFAULT_OPTIONS: Final = WireOptions()
"""Integer hashes, no group annotation."""


def _hash_list(hashes: Iterable[bytes], form: HashForm) -> list[int | bytes]:
    return [external_hash(h, form) for h in hashes]


def _schema() -> Any:
    try:
        from pagedkv.events import schema
    except ImportError:
        raise missing_dependency("msgspec") from None
    return schema


def _struct(schema: Any, event: KVCacheEvent, options: WireOptions) -> Any:
    form = options.hashes
    if type(event) is BlockStored:
        out = schema.BlockStored(
            block_hashes=_hash_list(event.block_hashes, form),
            parent_block_hash=None if event.parent_block_hash is None
            else external_hash(event.parent_block_hash, form),
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=event.lora_id,
            medium=event.medium, lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None
            else [None if keys is None else list(keys) for keys in event.extra_keys],
            group_idx=event.group_idx, session_id=event.session_id,
            lookahead_token_ids=None if event.lookahead_token_ids is None
            else [list(tokens) for tokens in event.lookahead_token_ids])
        if event.group_idx is not None and 0 <= event.group_idx < len(options.groups):
            meta = options.groups[event.group_idx]
            out.kv_cache_spec_kind, out.kv_cache_spec_sliding_window = meta.kind, meta.sliding_window
        return out
    if type(event) is BlockRemoved:
        return schema.BlockRemoved(block_hashes=_hash_list(event.block_hashes, form), medium=event.medium,
                                   group_idx=event.group_idx)
    if type(event) is AllBlocksCleared:
        return schema.AllBlocksCleared()
    raise TypeError(f"event must be BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}")


def _batch(events: Sequence[KVCacheEvent], ts: float | None, data_parallel_rank: int,
           options: WireOptions) -> Any:
    schema = _schema()
    return schema.KVEventBatch(ts=time.time() if ts is None else float(ts),
                               events=[_struct(schema, e, options) for e in events],
                               data_parallel_rank=data_parallel_rank)


def event_to_wire(event: KVCacheEvent, options: WireOptions = DEFAULT_OPTIONS) -> dict[str, Any]:
    """One event as the map vLLM 0.33 encodes (keys in its order, defaults left out).

    Raises:
        ImportError: msgspec is not installed (``pagedkv[events]``).
        TypeError: ``event`` is not one of pagedkv.spec.types' events.
    """
    schema = _schema()
    wire: dict[str, Any] = schema.msgspec.to_builtins(_struct(schema, event, options))
    return wire


def batch_to_wire(events: Sequence[KVCacheEvent], ts: float | None = None, data_parallel_rank: int = 0,
                  options: WireOptions = DEFAULT_OPTIONS) -> list[Any]:
    """A ``KVEventBatch`` as the array vLLM 0.33 encodes: ``[ts, events, rank]``
    (``ts`` defaults to now, in seconds since the epoch, as vLLM stamps it)."""
    wire: list[Any] = _schema().msgspec.to_builtins(_batch(events, ts, data_parallel_rank, options))
    return wire


def encode_batch(events: Sequence[KVCacheEvent], ts: float | None = None, data_parallel_rank: int = 0,
                 options: WireOptions = DEFAULT_OPTIONS) -> bytes:
    """The msgpack payload frame of one batch: vLLM 0.33's bytes for the same events.

    Raises:
        ImportError: msgspec is not installed (``pagedkv[events]``).
        TypeError: an event is not one of pagedkv.spec.types' events.
    """
    encoded: bytes = _schema().msgspec.msgpack.encode(_batch(events, ts, data_parallel_rank, options))
    return encoded


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A payload frame back as ``(ts, events, data_parallel_rank)``, events as maps.

    Raises:
        ImportError: msgspec is not installed.
        ValueError: the payload is not an array-encoded batch of map events.
    """
    try:
        import msgspec
    except ImportError:
        raise missing_dependency("msgspec") from None
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as error:
        raise ValueError(f"payload is not msgpack: {error}") from None
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3 or not isinstance(batch[1], list):
        raise ValueError("payload must be an array [ts, events, data_parallel_rank]")
    events = batch[1]
    for event in events:
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise ValueError("each event must be a map with a 'type' key")
    rank = batch[2] if len(batch) == 3 else None
    return float(batch[0]), events, rank
