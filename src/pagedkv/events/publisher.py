"""A ZMQ publisher of pagedkv's KV events, on vLLM 0.33's sockets.

The sockets and frames are vLLM's ``ZmqEventPublisher``'s, so a consumer
written for vLLM (Dynamo's indexer, llm-d) subscribes unchanged:

- a PUB socket sends each batch as three frames: the topic, the batch's
  sequence number (8 bytes, big-endian, from 0, one per batch) and the
  msgpack payload (:mod:`pagedkv.events.wire`);
- an optional ROUTER socket replays: a client (a DEALER) sends an empty
  frame and a start sequence (8 bytes, big-endian) and gets back, for each
  buffered batch from that sequence on, ``("", topic, seq, payload)``, then
  the end marker ``("", "", END_SEQ, "")``. The last ``buffer_steps``
  batches are kept.

Unlike vLLM's, :meth:`ZmqEventPublisher.publish` sends on the caller's
thread: a manager driven by a simulator or a test publishes in order with
no queue to drain. Replay requests are served by a daemon thread that owns
the ROUTER socket; the buffer is shared under a lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from pagedkv.events.wire import DEFAULT_OPTIONS, END_SEQ, WireOptions, encode_batch, missing_dependency
from pagedkv.spec.errors import InvalidArgumentError
from pagedkv.spec.types import KVCacheEvent

__all__ = ["ZmqEventPublisher"]


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise missing_dependency("pyzmq") from None
    return zmq


class ZmqEventPublisher:
    """Publishes batches of pagedkv events as vLLM 0.33 does (module docstring).

    ``endpoint`` is bound when it holds a ``*`` or is ipc/inproc and
    connected to otherwise (vLLM's rule); ``tcp://127.0.0.1:0`` binds a free
    port, read back from :attr:`endpoint`. ``replay_endpoint`` (bound) turns
    replay on.

    Raises:
        ImportError: pyzmq or msgspec is not installed (``pagedkv[events]``).
        InvalidArgumentError: ``buffer_steps`` or ``hwm`` not an int >= 1.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None, *,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0, options: WireOptions = DEFAULT_OPTIONS) -> None:
        if type(buffer_steps) is not int or buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be an int >= 1, got {buffer_steps!r}")
        if type(hwm) is not int or hwm < 1:
            raise InvalidArgumentError(f"hwm must be an int >= 1, got {hwm!r}")
        encode_batch([], 0.0)  # fail now, not at the first batch, when msgspec is absent
        zmq = _zmq()
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self.options = options
        self.data_parallel_rank = data_parallel_rank
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self.endpoint = self._attach(self._pub, endpoint)
        self.replay_endpoint: str | None = None
        self.replays_served = 0
        """Replay requests answered (each with its end marker)."""
        self._running = True
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            # Room for a whole replay and its end marker, as vLLM sizes it.
            replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            replay.bind(replay_endpoint)
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, args=(replay,), daemon=True,
                                            name="pagedkv-kv-events-replay")
            self._thread.start()

    def _attach(self, socket: Any, endpoint: str) -> str:
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")) \
                or endpoint.endswith(":0"):
            socket.bind(endpoint)
            return str(socket.getsockopt_string(self._zmq.LAST_ENDPOINT))
        socket.connect(endpoint)
        return endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> int | None:
        """Send ``events`` as one batch; return its sequence number (``None``
        for no events: vLLM publishes no empty batch).

        Raises:
            RuntimeError: the publisher was closed.
            TypeError: an event is not a pagedkv.spec.types event (nothing sent).
        """
        if not self._running:
            raise RuntimeError("publisher is closed")
        if not events:
            return None
        payload = encode_batch(events, ts, self.data_parallel_rank, self.options)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        return seq

    def _serve_replay(self, replay: Any) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        try:
            while self._running:
                if not poller.poll(50):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 3:  # not (client, "", start): ignored, as vLLM does
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                with self._lock:
                    buffered = [item for item in self._buffer if item[0] >= first]
                for seq, payload in buffered:
                    replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                replay.send_multipart((client, b"", b"", END_SEQ, b""))
                self.replays_served += 1
        finally:
            replay.close(linger=0)

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        if not self._running:
            return
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=100)  # let batches already queued go out

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
