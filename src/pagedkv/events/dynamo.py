"""NVIDIA Dynamo's standalone KV indexer, driven over its HTTP API.

``python -m dynamo.indexer`` (package ``ai-dynamo-runtime``) subscribes to
vLLM-format ZMQ event publishers, decodes them with Dynamo's own decoder,
keeps a radix tree of which worker holds which block, and answers:

- ``POST /register`` ``{instance_id, endpoint, replay_endpoint, model_name,
  block_size}``: subscribe to a worker (its replay socket is used to fill
  sequence gaps);
- ``POST /query`` ``{token_ids, model_name}``: per worker, the cached prefix
  of those tokens (in tokens, whole blocks);
- ``GET /dump``: the tree, as stored events per worker.

pagedkv runs it in a separate interpreter (its own venv: Dynamo's wheel is
large and pins its own dependencies) and talks to it here. The indexer is
an outside program: nothing of pagedkv's runs inside it, so what it
reports is what a real Dynamo router would see from pagedkv's events.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["DynamoNotInstalled", "INSTALL_HINT", "DEFAULT_VENV", "find_dynamo_python", "DynamoIndexer"]

DEFAULT_VENV = Path("~/.cache/pagedkv/router-venv")
"""Where ``make verify-router`` installs ai-dynamo-runtime (``ROUTER_VENV`` overrides it)."""

INSTALL_HINT = ("NVIDIA Dynamo's KV indexer is not installed. Install it into a venv outside the checkout: "
                "`make verify-router` does (ROUTER_VENV, default ~/.cache/pagedkv/router-venv), or "
                "`python3 -m venv ~/.cache/pagedkv/router-venv && "
                "~/.cache/pagedkv/router-venv/bin/pip install ai-dynamo-runtime==1.6.1`; "
                "then pass --dynamo-python VENV/bin/python or set PAGEDKV_DYNAMO_PYTHON.")


class DynamoNotInstalled(RuntimeError):
    """No interpreter with ``dynamo.indexer`` was found (the message says how to install one)."""


def _has_dynamo(python: str) -> bool:
    try:
        done = subprocess.run([python, "-c", "import dynamo.indexer, dynamo.llm"], capture_output=True,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_dynamo_python(explicit: str | None = None) -> str:
    """The interpreter to run ``python -m dynamo.indexer`` with: ``explicit``,
    else ``$PAGEDKV_DYNAMO_PYTHON``, else :data:`DEFAULT_VENV`'s, else this one.

    Raises:
        DynamoNotInstalled: the chosen (or every candidate) interpreter lacks Dynamo.
    """
    if explicit is None:
        explicit = os.environ.get("PAGEDKV_DYNAMO_PYTHON") or None
    if explicit is not None:
        if _has_dynamo(explicit):
            return explicit
        raise DynamoNotInstalled(f"{explicit} cannot import dynamo.indexer. {INSTALL_HINT}")
    for candidate in (str(DEFAULT_VENV.expanduser() / "bin" / "python"), sys.executable):
        if Path(candidate).exists() and _has_dynamo(candidate):
            return candidate
    raise DynamoNotInstalled(INSTALL_HINT)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class DynamoIndexer:
    """A ``dynamo.indexer`` process on a loopback port, and a client for it.

    ``test_endpoints`` mounts the indexer's listener pause/resume endpoints
    (``DYN_KV_INDEXER_TEST_ENDPOINTS``), with which a test makes the indexer
    miss batches and then recover them through the replay socket.

    Raises:
        DynamoNotInstalled: as :func:`find_dynamo_python`.
        TimeoutError: the indexer did not answer ``/health`` within ``start_timeout`` seconds.
    """

    def __init__(self, python: str | None = None, *, threads: int = 1, test_endpoints: bool = False,
                 log_path: str | None = None, start_timeout: float = 60.0) -> None:
        self.python = find_dynamo_python(python)
        self.port = _free_port()
        env = dict(os.environ)
        if test_endpoints:
            env["DYN_KV_INDEXER_TEST_ENDPOINTS"] = "1"
        env.setdefault("DYN_LOG", "warn")
        self._log = open(log_path or os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [self.python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", str(threads)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._conn: http.client.HTTPConnection | None = None
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                self._call("GET", "/health")
                break
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"dynamo.indexer exited with status {self.process.returncode}") from None
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"dynamo.indexer did not start within {start_timeout} s") from None
                time.sleep(0.1)

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        for attempt in (0, 1):  # one retry on a dropped keep-alive connection
            if self._conn is None:
                self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self._conn.request(method, path, body=data,
                                   headers={"Content-Type": "application/json"} if data is not None else {})
                response = self._conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
                continue
            text = raw.decode("utf-8")
            return response.status, (json.loads(text) if text.strip() else None)
        raise AssertionError("unreachable")

    def _ok(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = self._call(method, path, body)
        if not 200 <= status < 300:
            raise RuntimeError(f"dynamo.indexer {method} {path}: HTTP {status}: {answer}")
        return answer

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str | None, *, model_name: str,
                 block_size: int) -> None:
        """Subscribe the indexer to one worker's publisher."""
        body: dict[str, Any] = {"instance_id": instance_id, "endpoint": endpoint, "model_name": model_name,
                                "block_size": block_size}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._ok("POST", "/register", body)

    def unregister(self, instance_id: int, *, model_name: str) -> None:
        """Drop a worker and every block the indexer holds for it."""
        self._ok("POST", "/unregister", {"instance_id": instance_id, "model_name": model_name})

    def workers(self) -> list[dict[str, Any]]:
        """The registered workers and their listeners' status."""
        answer = self._ok("GET", "/workers")
        return list(answer) if isinstance(answer, list) else []

    def wait_listening(self, count: int, timeout: float = 30.0) -> None:
        """Wait until ``count`` listeners are active.

        Raises:
            TimeoutError: they were not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            active = sum(1 for worker in self.workers() for listener in worker.get("listeners", {}).values()
                         if listener.get("status") == "active")
            if active >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{active} of {count} indexer listeners active after {timeout} s")
            time.sleep(0.05)

    def query(self, token_ids: list[int], *, model_name: str) -> dict[int, int]:
        """Per worker id, how many leading tokens of ``token_ids`` it holds (whole blocks)."""
        answer = self._ok("POST", "/query", {"token_ids": token_ids, "model_name": model_name})
        scores = answer.get("scores", {}) if isinstance(answer, dict) else {}
        return {int(worker): max(ranks.values(), default=0) for worker, ranks in scores.items()}

    def dump(self, *, model_name: str) -> dict[int, set[int]]:
        """Per worker id, the engine block hashes the indexer's tree holds for it."""
        answer = self._ok("GET", "/dump")
        held: dict[int, set[int]] = {}
        for key, model in (answer or {}).items():
            if key.split(":")[0] != model_name:
                continue
            for entry in model.get("events", []):
                stored = entry.get("event", {}).get("data", {}).get("stored")
                if stored is None:
                    continue
                blocks = held.setdefault(int(entry["worker_id"]), set())
                blocks.update(int(block["block_hash"]) for block in stored.get("blocks", []))
        return held

    def pause(self, instance_id: int) -> None:
        """Stop the indexer's listener of a worker (needs ``test_endpoints``)."""
        self._ok("POST", "/test/pause_listener", {"instance_id": instance_id})

    def resume(self, instance_id: int) -> None:
        """Restart a paused listener; a sequence gap it then sees is filled by replay."""
        self._ok("POST", "/test/resume_listener", {"instance_id": instance_id})

    def close(self) -> None:
        """Stop the indexer process (idempotent)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> DynamoIndexer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
