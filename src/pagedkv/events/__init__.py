"""pagedkv's KV cache events on vLLM 0.33's wire (ZMQ + msgpack).

A KV-aware router (NVIDIA Dynamo's KV indexer, llm-d's prefix-cache scorer)
learns what each replica caches only from the events the replica
publishes. This package sends a pagedkv manager's events
(:meth:`KVCacheManager.take_events`) exactly as vLLM 0.33 does, so those
routers read a pagedkv replica as they read vLLM:

- :mod:`pagedkv.events.wire`: the msgpack encoding (array batch, map events,
  vLLM 0.33's field names, integer hashes);
- :mod:`pagedkv.events.publisher`: the PUB socket and the replay ROUTER;
- :mod:`pagedkv.events.subscriber`: the consumer side, for tests and tools.

Needs ``pip install 'pagedkv[events]'`` (pyzmq, msgspec); ``import
pagedkv`` does not import this package. docs/fleet.md runs replicas behind
Dynamo.
"""

from pagedkv.events.publisher import ZmqEventPublisher
from pagedkv.events.subscriber import ReceivedBatch, ZmqEventSubscriber
from pagedkv.events.wire import (
    END_SEQ,
    GroupMetadata,
    WireOptions,
    batch_to_wire,
    decode_batch,
    encode_batch,
    event_to_wire,
    external_hash,
    group_metadata,
)

__all__ = ["END_SEQ", "GroupMetadata", "ReceivedBatch", "WireOptions", "ZmqEventPublisher",
           "ZmqEventSubscriber", "batch_to_wire", "decode_batch", "encode_batch", "event_to_wire",
           "external_hash", "group_metadata"]
