"""pagedkv.events on vLLM 0.33's wire: the msgpack schema read back with a
plain msgpack decoder (no pagedkv or vLLM types), the sockets over real
loopback ZMQ (live stream and replay), and byte-for-byte equality with
vLLM 0.33's own encoder classes where vLLM is importable."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.types import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.trace import standard_kv_cache_config

msgpack = pytest.importorskip("msgpack", reason="the independent decoder is msgpack (pagedkv[dev])")
pytest.importorskip("msgspec", reason="pagedkv.events encodes with msgspec (pagedkv[events])")
pytest.importorskip("zmq", reason="pagedkv.events publishes with pyzmq (pagedkv[events])")

from pagedkv.events import (  # noqa: E402  (after the skips: the package needs them)
    END_SEQ,
    GroupMetadata,
    WireOptions,
    ZmqEventPublisher,
    ZmqEventSubscriber,
    encode_batch,
    external_hash,
    group_metadata,
)

STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name"]
"""vLLM 0.33's BlockStored fields without a default: always written, in this order."""
STORED_OPTIONAL = ["extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                   "locality", "ownership", "session_id", "lookahead_token_ids"]


def _low64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def _manager_events(block_size: int = 4) -> tuple[list[KVCacheEvent], pagedkv.KVCacheManager]:
    """Stores (two runs: a chain and its continuation), a removal on reuse, a reset."""
    config = standard_kv_cache_config(4, block_size)  # 3 usable blocks: the fourth store evicts
    manager = pagedkv.KVCacheManager(config, 64, enable_kv_cache_events=True, hash_seed="0")
    first = manager.make_request("a", list(range(1, 2 * block_size + 2)))
    manager.allocate_slots(first, 2 * block_size + 1)
    manager.free(first)
    second = manager.make_request("b", list(range(100, 100 + 2 * block_size)))
    hit, hit_tokens = manager.get_computed_blocks(second)
    manager.allocate_slots(second, 2 * block_size - hit_tokens, hit_tokens, hit)
    manager.free(second)
    manager.reset_prefix_cache()
    return manager.take_events(), manager


def test_schema_read_by_a_plain_msgpack_decoder() -> None:
    events, manager = _manager_events()
    options = WireOptions(groups=group_metadata(manager.kv_cache_config))
    batch = msgpack.unpackb(encode_batch(events, ts=12.5, data_parallel_rank=3, options=options), raw=False)
    assert isinstance(batch, list) and len(batch) == 3  # array-encoded KVEventBatch
    ts, wire, rank = batch
    assert ts == 12.5 and rank == 3 and len(wire) == len(events)
    kinds = [event["type"] for event in wire]
    assert kinds == [type(event).__name__ for event in events]
    assert kinds.count("BlockStored") >= 2 and "BlockRemoved" in kinds and kinds[-1] == "AllBlocksCleared"
    for event, sent in zip(events, wire):
        if isinstance(event, BlockStored):
            keys = list(sent)
            assert keys[:len(STORED_KEYS)] == STORED_KEYS
            assert keys[len(STORED_KEYS):] == [k for k in STORED_OPTIONAL if k in sent]
            assert sent["block_hashes"] == [_low64(h) for h in event.block_hashes]
            assert all(type(h) is int and 0 <= h < 2 ** 64 for h in sent["block_hashes"])
            parent = event.parent_block_hash
            assert sent["parent_block_hash"] == (None if parent is None else _low64(parent))
            assert sent["token_ids"] == list(event.token_ids)
            assert len(sent["token_ids"]) == sent["block_size"] * len(sent["block_hashes"])
            assert sent["medium"] == "GPU" and sent["lora_id"] is None and sent["lora_name"] is None
            assert sent["group_idx"] == 0 and sent["kv_cache_spec_kind"] == "full_attention"
        elif isinstance(event, BlockRemoved):
            assert sent == {"type": "BlockRemoved", "block_hashes": [_low64(h) for h in event.block_hashes],
                            "medium": "GPU", "group_idx": 0}
        else:
            assert sent == {"type": "AllBlocksCleared"}
    # The second store continues the first request's chain: its parent is the hash before it.
    stored = [e for e in wire if e["type"] == "BlockStored"]
    assert stored[0]["parent_block_hash"] is None


def test_bytes_hashes_and_unannotated_groups() -> None:
    digest = bytes(range(32))
    event = BlockStored(block_hashes=(BlockHash(digest),), parent_block_hash=None, token_ids=(1, 2),
                        block_size=2, lora_id=None)
    sent = msgpack.unpackb(encode_batch([event, BlockRemoved((BlockHash(digest),))], 0.0,
                                        options=WireOptions(hashes="bytes")), raw=False)[1]
    assert sent[0]["block_hashes"] == [digest] and "group_idx" not in sent[0]
    assert sent[1] == {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"}
    assert external_hash(digest) == _low64(digest)


def test_rejects_a_foreign_event_and_sends_nothing() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:0") as publisher:
        with pytest.raises(TypeError, match="BlockStored"):
            publisher.publish([object()])  # type: ignore[list-item]
        assert publisher.next_seq == 0
        assert publisher.publish([]) is None and publisher.next_seq == 0


@pytest.mark.parametrize("bad", [{"buffer_steps": 0}, {"hwm": 0}, {"buffer_steps": 2.5}])
def test_publisher_refuses_bad_limits(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        ZmqEventPublisher("tcp://127.0.0.1:0", **bad)


def test_no_dynamo_names_the_install(tmp_path: Any) -> None:
    from pagedkv.events.dynamo import DynamoNotInstalled, find_dynamo_python

    with pytest.raises(DynamoNotInstalled, match="ai-dynamo-runtime"):
        find_dynamo_python(str(tmp_path / "no-such-python"))


def _wait_subscribed(publisher: ZmqEventPublisher, subscriber: ZmqEventSubscriber) -> int:
    """PUB drops what it sends before the subscription arrives: probe until one
    batch gets through; return how many probes were sent."""
    for sent in range(1, 200):
        publisher.publish([AllBlocksCleared()])
        if subscriber.recv(timeout_ms=20) is not None:
            return sent
    raise AssertionError("subscription never reached the publisher")


def test_loopback_stream_and_replay() -> None:
    events, manager = _manager_events()
    options = WireOptions(groups=group_metadata(manager.kv_cache_config))
    with ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv", buffer_steps=64,
                           options=options) as publisher:
        assert publisher.replay_endpoint is not None
        subscriber = ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv")
        try:
            probes = _wait_subscribed(publisher, subscriber)
            while subscriber.recv(timeout_ms=50) is not None:  # late probes
                pass
            batches = [events[:2], events[2:-1], events[-1:]]
            seqs = [publisher.publish(batch, ts=float(i)) for i, batch in enumerate(batches)]
            assert seqs == [probes, probes + 1, probes + 2]
            live = [subscriber.recv() for _ in batches]
            for i, (got, batch) in enumerate(zip(live, batches)):
                assert got is not None and got.topic == b"kv" and got.seq == probes + i
                assert got.payload == encode_batch(batch, float(i), options=options)
                assert [e["type"] for e in got.events] == [type(e).__name__ for e in batch]
            replayed = subscriber.replay(0)  # a router that joined late: everything buffered
            assert [b.seq for b in replayed] == list(range(probes + 3))
            assert [b.payload for b in replayed[probes:]] == [b.payload for b in live if b is not None]
            assert [b.seq for b in subscriber.replay(probes + 2)] == [probes + 2]
            assert subscriber.replay(probes + 3) == []  # up to date: only the end marker
        finally:
            subscriber.close()


def test_replay_keeps_only_the_last_buffer_steps_batches() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=2) as publisher:
        for _ in range(5):
            publisher.publish([AllBlocksCleared()], ts=1.0)
        subscriber = ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
        try:
            assert [b.seq for b in subscriber.replay(0)] == [3, 4]
        finally:
            subscriber.close()
    assert END_SEQ == b"\xff" * 8


def test_group_metadata_names_vllms_kinds() -> None:
    assert group_metadata(standard_kv_cache_config(8, 16, "gemma3")) == (
        (GroupMetadata("sliding_window", 1024),) * 5 + (GroupMetadata("full_attention"),))


# -- byte for byte against vLLM 0.33's encoder ------------------------------

_hashes = st.binary(min_size=32, max_size=32).map(BlockHash)
_stored = st.builds(
    BlockStored, block_hashes=st.lists(_hashes, min_size=0, max_size=3).map(tuple),
    parent_block_hash=st.none() | _hashes, token_ids=st.lists(st.integers(0, 2 ** 31), max_size=6).map(tuple),
    block_size=st.sampled_from([1, 16, 512]), lora_id=st.none() | st.integers(1, 9),
    medium=st.just("GPU"), lora_name=st.none() | st.text(max_size=40), group_idx=st.none() | st.integers(0, 2),
    session_id=st.none() | st.text(max_size=5),
    lookahead_token_ids=st.none() | st.lists(st.lists(st.integers(0, 9), max_size=2).map(tuple),
                                             max_size=2).map(tuple))
_removed = st.builds(BlockRemoved, st.lists(_hashes, min_size=1, max_size=2).map(tuple),
                     group_idx=st.none() | st.integers(0, 2))
_events = st.lists(st.one_of(_stored, _removed,
                             st.just(AllBlocksCleared())), max_size=5)
_groups = (GroupMetadata("sliding_window", 1024), GroupMetadata("full_attention"))


def _as_vllm(kv: Any, event: KVCacheEvent, options: WireOptions) -> Any:
    def ext(block_hash: bytes) -> int | bytes:
        return external_hash(block_hash, options.hashes)

    if isinstance(event, BlockStored):
        out = kv.BlockStored(
            block_hashes=[ext(h) for h in event.block_hashes],
            parent_block_hash=None if event.parent_block_hash is None else ext(event.parent_block_hash),
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=event.lora_id,
            medium=event.medium, lora_name=event.lora_name, group_idx=event.group_idx,
            session_id=event.session_id,
            lookahead_token_ids=None if event.lookahead_token_ids is None
            else [list(t) for t in event.lookahead_token_ids])
        if event.group_idx is not None and event.group_idx < len(options.groups):
            out.kv_cache_spec_kind = options.groups[event.group_idx].kind
            out.kv_cache_spec_sliding_window = options.groups[event.group_idx].sliding_window
        return out
    if isinstance(event, BlockRemoved):
        return kv.BlockRemoved(block_hashes=[ext(h) for h in event.block_hashes], medium=event.medium,
                               group_idx=event.group_idx)
    return kv.AllBlocksCleared()


@settings(max_examples=60, deadline=None)
@given(events=_events, ts=st.floats(0, 2e9), rank=st.integers(0, 7), hashes=st.sampled_from(["int", "bytes"]),
       groups=st.sampled_from([(), _groups[1:], _groups]))
def test_bytes_equal_vllms_encoder(events: list[KVCacheEvent], ts: float, rank: int, hashes: Any,
                                   groups: tuple[GroupMetadata, ...]) -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM 0.33 is not importable here")
    import msgspec

    options = WireOptions(hashes=hashes, groups=groups)
    theirs = msgspec.msgpack.Encoder().encode(
        kv.KVEventBatch(ts=ts, events=[_as_vllm(kv, e, options) for e in events], data_parallel_rank=rank))
    assert encode_batch(events, ts, rank, options) == theirs
    # And vLLM's own decoder reads pagedkv's bytes back into its classes.
    decoded = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(encode_batch(events, ts, rank, options))
    assert [type(e).__name__ for e in decoded.events] == [type(e).__name__ for e in events]


def test_publisher_times_its_batches() -> None:
    before = time.time()
    payload = msgpack.unpackb(encode_batch([AllBlocksCleared()]), raw=False)
    assert before <= payload[0] <= time.time()
