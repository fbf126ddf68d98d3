"""Sends the workload's calls to the server and records what came back.

Two clients, as users have them: raw HTTP (`http.client`, which can close a connection at any
byte: before the response, after the headers, between two chunks) and the `openai` package (its
streams closed with `stream.close()`, its retries off so a 5xx is seen, not retried). Every
socket has a timeout: a response that does not come is recorded as `hung`, never waited for.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import plan as pl

REQUEST_TIMEOUT_S = 90.0

# Outcomes of one call.
COMPLETED = "completed"  # 200 and a whole response (for a reset: the answer, success or not)
ABORTED = "aborted"  # the client closed it, as planned
REFUSED = "refused"  # 4xx
SERVER_ERROR = "5xx"
HUNG = "hung"  # no answer within REQUEST_TIMEOUT_S
BROKEN = "broken"  # the connection failed or the response was malformed


@dataclass
class Outcome:
    name: str
    phase: str
    kind: str
    result: str
    status: int | None = None
    message: str = ""
    # Per choice index: the output token ids, and why it finished.
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    cached: int = -1
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _body(call: pl.Call, model: str) -> dict[str, Any]:
    body = dict(call.body or {})
    if body.get("model") == pl.MODEL:
        body["model"] = model
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def _error_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
        if isinstance(data, dict):
            err = data.get("error", data)
            if isinstance(err, dict):
                return str(err.get("message", "") or err.get("detail", ""))
            return str(err)
    except ValueError:
        pass
    return raw.decode(errors="replace")[:300]


def _close(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    conn.close()


def _take_choices(out: Outcome, data: dict[str, Any]) -> None:
    for choice in data.get("choices") or []:
        idx = int(choice.get("index", 0))
        ids = choice.get("token_ids")
        if ids is None:  # the word-level tokenizer: one word per token
            ids = [int(w[1:]) for w in (choice.get("text") or "").split() if w[1:].isdigit()]
        out.tokens.setdefault(idx, []).extend(int(t) for t in ids)
        if choice.get("finish_reason"):
            out.finish[idx] = str(choice["finish_reason"])
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        out.cached = int(details["cached_tokens"])


def _send_raw(call: pl.Call, port: int, model: str, out: Outcome) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        data = call.raw if call.raw is not None else json.dumps(_body(call, model)).encode()
        conn.request("POST", call.path + call.query, body=data,
                     headers={"Content-Type": "application/json", **call.headers})
        if call.action == pl.CLOSE_AT_ONCE:
            out.result = ABORTED
            return
        r = conn.getresponse()
        out.status = r.status
        if r.status != 200:
            out.message = _error_message(r.read(1 << 16))
            out.result = REFUSED if 400 <= r.status < 500 else SERVER_ERROR if r.status >= 500 else BROKEN
            return
        if not (call.body or {}).get("stream"):
            answer = json.loads(r.read())
            if call.path == "/reset_prefix_cache":
                out.message = f"success={answer.get('success')}"
            _take_choices(out, answer)
            out.result = COMPLETED
            return
        if call.action == pl.CLOSE_AFTER_HEADERS:
            out.result = ABORTED
            return
        chunks = 0
        stall = call.action == pl.CLOSE_WHEN_STALLED
        if stall and conn.sock is not None:
            conn.sock.settimeout(pl.STALL_S)
        while True:
            try:
                line = r.readline()
            except TimeoutError:
                if stall:
                    out.result = ABORTED
                    return
                raise
            if not line:
                out.result = BROKEN
                out.message = "stream ended without [DONE]"
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out.result = COMPLETED
                return
            chunk = json.loads(payload)
            if "error" in chunk:  # an error inside a stream (the status was 200 already)
                out.message = _error_message(payload)
                code = int((chunk["error"] or {}).get("code") or 500)
                out.status = code
                out.result = REFUSED if 400 <= code < 500 else SERVER_ERROR
                return
            _take_choices(out, chunk)
            if chunk.get("choices"):
                chunks += 1
            if call.action in (pl.CLOSE_AFTER_TOKENS, pl.CLOSE_WHEN_STALLED) and chunks >= call.close_after:
                out.result = ABORTED
                return
    finally:
        _close(conn)


def _send_openai(call: pl.Call, port: int, model: str, out: Outcome) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S,
                           max_retries=0)
    body = _body(call, model)
    known = {"model", "prompt", "max_tokens", "temperature", "n", "stop", "stream", "stream_options", "best_of",
             "seed", "logprobs", "top_p"}
    kwargs = {k: v for k, v in body.items() if k in known}
    kwargs["extra_body"] = {k: v for k, v in body.items() if k not in known}
    kwargs["extra_headers"] = call.headers or None
    try:
        if not body.get("stream"):
            r = client.completions.create(**kwargs)
            _take_choices(out, r.model_dump())
            out.status, out.result = 200, COMPLETED
            return
        stream = client.completions.create(**kwargs)
        out.status = 200
        chunks = 0
        with stream:
            for chunk in stream:
                data = chunk.model_dump()
                _take_choices(out, data)
                if data.get("choices"):
                    chunks += 1
                if call.action == pl.CLOSE_AFTER_TOKENS and chunks >= call.close_after:
                    out.result = ABORTED
                    return  # leaving the `with` closes the connection
        out.result = COMPLETED
    except openai.APIStatusError as exc:
        out.status = exc.status_code
        out.message = _error_message(exc.response.content) if exc.response is not None else str(exc)
        out.result = REFUSED if 400 <= exc.status_code < 500 else SERVER_ERROR
    finally:
        client.close()


def send(call: pl.Call, port: int, model: str) -> Outcome:
    """One call, with its planned client action; never raises (a failure is an outcome)."""
    out = Outcome(call.name, call.phase, call.kind, BROKEN)
    t0 = time.monotonic()
    try:
        if call.client == "openai" and call.raw is None and call.path == "/v1/completions":
            _send_openai(call, port, model, out)
        else:
            _send_raw(call, port, model, out)
    except TimeoutError as exc:
        out.result, out.message = HUNG, f"no answer in {REQUEST_TIMEOUT_S} s: {exc}"
    except Exception as exc:  # a timeout inside the openai client lands here too
        timed_out = "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()
        out.result = HUNG if timed_out else BROKEN
        out.message = f"{type(exc).__name__}: {exc}"[:300]
    out.seconds = time.monotonic() - t0
    return out


def send_all(calls: list[pl.Call], port: int, model: str, concurrency: int) -> list[Outcome]:
    """The calls in order, `concurrency` at a time (1: one after the other); outcomes in call order."""
    if concurrency <= 1:
        return [send(c, port, model) for c in calls]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda c: send(c, port, model), calls))
