"""A subscriber for vLLM-format KV event streams (pagedkv's or vLLM's).

It is the consumer half of :mod:`pagedkv.events.publisher`: a SUB socket
for the live stream and, on demand, a DEALER socket that asks the
publisher's ROUTER to replay from a sequence number, the way a router that
joined late or missed batches catches up. Payloads are decoded with
:func:`pagedkv.events.wire.decode_batch` (plain maps, no pagedkv types), so
what it returns is what any msgpack consumer sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.events.wire import END_SEQ, decode_batch, missing_dependency

__all__ = ["ReceivedBatch", "ZmqEventSubscriber"]


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One batch as received: topic, sequence number, decoded payload, raw payload."""

    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None
    payload: bytes


def _received(topic: bytes, seq: bytes, payload: bytes) -> ReceivedBatch:
    ts, events, rank = decode_batch(payload)
    return ReceivedBatch(topic, int.from_bytes(seq, "big"), ts, events, rank, payload)


class ZmqEventSubscriber:
    """Subscribes to ``endpoint`` (topic prefix ``topic``); replays from
    ``replay_endpoint`` when given.

    Raises:
        ImportError: pyzmq or msgspec is not installed (``pagedkv[events]``).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        try:
            import zmq
        except ImportError:
            raise missing_dependency("pyzmq") from None
        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    def recv(self, timeout_ms: int = 1000) -> ReceivedBatch | None:
        """The next live batch, or ``None`` if none came within ``timeout_ms``."""
        if not self._sub.poll(timeout_ms):
            return None
        topic, seq, payload = self._sub.recv_multipart()
        return _received(topic, seq, payload)

    def replay(self, start_seq: int, timeout_ms: int = 2000) -> list[ReceivedBatch]:
        """The publisher's buffered batches from ``start_seq`` on, up to its end marker.

        Raises:
            ValueError: no replay endpoint was given.
            TimeoutError: the publisher did not answer within ``timeout_ms`` per frame.
        """
        if self.replay_endpoint is None:
            raise ValueError("replay needs replay_endpoint")
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            batches: list[ReceivedBatch] = []
            while True:
                if not dealer.poll(timeout_ms):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint} in {timeout_ms} ms")
                _, topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return batches
                batches.append(_received(topic, seq, payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        """Close the SUB socket."""
        self._sub.close(linger=0)
