"""Workloads: the requests a simulation replays, read from trace files.

Semantic model: a workload is a list of requests in arrival order. Each
request has an arrival time, a prompt length, an output length and the
*block ids* of its prompt: one id per ``block_tokens`` prompt tokens (the
last block may be partial), where equal ids at equal positions mean equal
content *and* equal prefix -- an id stands for its block and everything
before it, as in the Mooncake traces. Tokens are made from the ids later
(``pagedkv.simulate.requests``), so a workload stays small: 12,031
requests of the Mooncake conversation trace are ~300k ints.

Readers, one per format (:func:`load_workload` picks by ``fmt``):

- Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (512-token blocks).
- Bailian-style JSONL: the same fields with ``hash_ids`` over 16-token
  blocks, ``timestamp`` in seconds, and the session fields ``chat_id``,
  ``parent_chat_id`` (-1 for a first turn), ``turn``; chosen when lines carry
  ``chat_id``.
- Length-only CSV (Azure LLM inference: ``TIMESTAMP,ContextTokens,
  GeneratedTokens``; BurstGPT: ``Timestamp,...,Request tokens,Response
  tokens,...``): no prefix information, so every prompt is unique unless
  a synthetic shared prefix is asked for (:class:`SharedPrefix`).
- ``chat``: the project's standard chat trace (``pagedkv.trace``).

Malformed input raises :class:`TraceFormatError` naming the file, the line
and the field.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from pagedkv.spec.errors import InvalidArgumentError

__all__ = [
    "TraceRequest", "Workload", "SharedPrefix", "TraceFormatError", "FORMATS",
    "load_workload", "read_jsonl", "read_csv", "chat_workload", "MOONCAKE_BLOCK_TOKENS",
    "BAILIAN_BLOCK_TOKENS",
]

MOONCAKE_BLOCK_TOKENS: Final = 512
BAILIAN_BLOCK_TOKENS: Final = 16
CSV_BLOCK_TOKENS: Final = 16
FORMATS: Final[tuple[str, ...]] = ("auto", "mooncake", "bailian", "csv", "chat")
_MAX_ID: Final = 1 << 48  # ids become three 16-bit tokens (requests.TokenSource)


class TraceFormatError(InvalidArgumentError):
    """A trace file is malformed; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload (see the module docstring)."""

    arrival_ms: float
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]
    session: int | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests in arrival order; ``block_tokens`` tokens per block id."""

    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of every request together."""
        return sum(r.input_length for r in self.requests)

    @property
    def output_tokens(self) -> int:
        """Output tokens of every request together."""
        return sum(r.output_length for r in self.requests)

    def limited(self, limit: int | None) -> Workload:
        """The first ``limit`` requests (all when ``None``)."""
        if limit is None or limit >= len(self.requests):
            return self
        return Workload(self.name, self.block_tokens, self.requests[:limit])


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A synthetic shared prefix for length-only traces: each prompt starts
    with one of ``groups`` system prompts of ``tokens`` tokens (drawn with
    ``random.Random(seed)``); a prompt shorter than that is all prefix."""

    tokens: int
    groups: int = 1
    seed: int = 0


def _fail(path: str, line: int, field: str | None, message: str) -> TraceFormatError:
    where = f"{path}:{line}" + (f": field {field!r}" if field else "")
    return TraceFormatError(f"{where}: {message}")


def _int_field(record: dict[str, Any], field: str, path: str, line: int, minimum: int) -> int:
    if field not in record:
        raise _fail(path, line, field, "missing")
    value = record[field]
    if type(value) is not int or value < minimum:
        raise _fail(path, line, field, f"must be an int >= {minimum}, got {value!r}")
    return value


def _number_field(record: dict[str, Any], field: str, path: str, line: int) -> float:
    if field not in record:
        raise _fail(path, line, field, "missing")
    value = record[field]
    if type(value) not in (int, float) or value != value or value < 0:
        raise _fail(path, line, field, f"must be a non-negative number, got {value!r}")
    return float(value)


def _check_ids(ids: object, input_length: int, block_tokens: int, path: str, line: int) -> tuple[int, ...]:
    if not isinstance(ids, list):
        raise _fail(path, line, "hash_ids", f"must be a list of ints, got {type(ids).__name__}")
    for block_id in ids:
        if type(block_id) is not int or not 0 <= block_id < _MAX_ID:
            raise _fail(path, line, "hash_ids", f"ids must be ints in [0, 2**48), got {block_id!r}")
    needed = -(-input_length // block_tokens)
    if len(ids) != needed:
        raise _fail(path, line, "hash_ids",
                    f"has {len(ids)} ids; input_length {input_length} needs {needed} blocks "
                    f"of {block_tokens} tokens")
    return tuple(ids)


def _json_lines(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise _fail(path, number, None, f"not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise _fail(path, number, None, f"expected a JSON object, got {type(record).__name__}")
            yield number, record


def read_jsonl(path: str, fmt: str = "auto", block_tokens: int | None = None) -> Workload:
    """A Mooncake or Bailian-style JSONL trace (``fmt`` "mooncake", "bailian"
    or "auto": Bailian when the first line has ``chat_id``). ``block_tokens``
    overrides the format's tokens per id. Requests are sorted by arrival,
    ties kept in file order.

    Raises:
        TraceFormatError: a malformed line (its number and field named), an
            empty file.
    """
    requests: list[TraceRequest] = []
    sessions: dict[int, int] = {}
    for number, record in _json_lines(path):
        if fmt == "auto":
            fmt = "bailian" if "chat_id" in record else "mooncake"
        bailian = fmt == "bailian"
        tokens = block_tokens or (BAILIAN_BLOCK_TOKENS if bailian else MOONCAKE_BLOCK_TOKENS)
        timestamp = _number_field(record, "timestamp", path, number)
        input_length = _int_field(record, "input_length", path, number, 1)
        output_length = _int_field(record, "output_length", path, number, 0)
        if "hash_ids" not in record:
            raise _fail(path, number, "hash_ids", "missing")
        ids = _check_ids(record["hash_ids"], input_length, tokens, path, number)
        session = None
        if bailian:
            chat_id = _int_field(record, "chat_id", path, number, 0)
            parent = record.get("parent_chat_id", -1)
            if type(parent) is not int or parent < -1:
                raise _fail(path, number, "parent_chat_id", f"must be an int >= -1, got {parent!r}")
            # A session is the first turn's chat id, followed through the parents.
            session = sessions.get(parent, parent) if parent >= 0 else chat_id
            sessions[chat_id] = session
        arrival = timestamp * 1000.0 if bailian else timestamp
        requests.append(TraceRequest(arrival, input_length, output_length, ids, session))
    if not requests:
        raise TraceFormatError(f"{path}: no requests in the file")
    requests.sort(key=lambda r: r.arrival_ms)
    tokens = block_tokens or (BAILIAN_BLOCK_TOKENS if fmt == "bailian" else MOONCAKE_BLOCK_TOKENS)
    return Workload(Path(path).name, tokens, tuple(requests))


_CSV_COLUMNS: Final[dict[str, tuple[str, str, str]]] = {
    # format: (timestamp, prompt tokens, output tokens)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}


def _csv_time(text: str, path: str, line: int, column: str) -> float:
    """Seconds: a number, or an ISO date-time (Azure; 7-digit fractions cut to 6)."""
    try:
        return float(text)
    except ValueError:
        pass
    cleaned = text.strip()
    if "." in cleaned:
        head, fraction = cleaned.split(".", 1)
        cleaned = f"{head}.{fraction[:6]}"
    try:
        return datetime.fromisoformat(cleaned).timestamp()
    except ValueError:
        raise _fail(path, line, column, f"not a number of seconds or a date-time: {text!r}") from None


def _csv_int(row: dict[str, str], column: str, path: str, line: int, minimum: int) -> int:
    text = (row.get(column) or "").strip()
    try:
        value = int(float(text)) if text and float(text).is_integer() else int(text)
    except ValueError:
        raise _fail(path, line, column, f"must be an int >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise _fail(path, line, column, f"must be an int >= {minimum}, got {value}")
    return value


def read_csv(path: str, shared_prefix: SharedPrefix | None = None,
             block_tokens: int = CSV_BLOCK_TOKENS) -> Workload:
    """A length-only CSV trace (Azure or BurstGPT columns, found from the
    header). Rows with a zero-token prompt are skipped (BurstGPT logs failed
    requests so). Without ``shared_prefix`` every prompt is unique.

    Raises:
        TraceFormatError: unknown columns, a malformed cell (line and column
            named), an empty file.
    """
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        header = [name.strip() for name in reader.fieldnames or []]
        reader.fieldnames = header
        columns = next((c for c in _CSV_COLUMNS.values() if all(name in header for name in c)), None)
        if columns is None:
            expected = " or ".join(",".join(c) for c in _CSV_COLUMNS.values())
            raise _fail(path, 1, None, f"unknown CSV columns {header}; expected {expected}")
        time_column, prompt_column, output_column = columns
        raw: list[tuple[float, int, int]] = []
        for line, row in enumerate(reader, start=2):
            prompt = _csv_int(row, prompt_column, path, line, 0)
            output = _csv_int(row, output_column, path, line, 0)
            seconds = _csv_time(row.get(time_column) or "", path, line, time_column)
            if prompt > 0:
                raw.append((seconds, prompt, output))
    if not raw:
        raise TraceFormatError(f"{path}: no requests with a prompt in the file")
    raw.sort(key=lambda r: r[0])
    start = raw[0][0]
    rng = random.Random(shared_prefix.seed if shared_prefix else 0)
    next_id = 0
    prefix_ids: list[tuple[int, ...]] = []
    prefix_blocks = 0
    if shared_prefix is not None:
        # Whole blocks of each system prompt get fixed ids; the block that
        # straddles the prefix and the unique part is unique to its request.
        prefix_blocks = shared_prefix.tokens // block_tokens
        for _ in range(shared_prefix.groups):
            prefix_ids.append(tuple(range(next_id, next_id + prefix_blocks)))
            next_id += prefix_blocks
    requests: list[TraceRequest] = []
    for seconds, prompt, output in raw:
        blocks = -(-prompt // block_tokens)
        shared: tuple[int, ...] = ()
        if prefix_ids:
            shared = prefix_ids[rng.randrange(len(prefix_ids))][:min(prefix_blocks, blocks)]
        unique = blocks - len(shared)
        ids = shared + tuple(range(next_id, next_id + unique))
        next_id += unique
        requests.append(TraceRequest((seconds - start) * 1000.0, prompt, output, ids))
    return Workload(Path(path).name, block_tokens, tuple(requests))


def chat_workload(num_requests: int = 256, seed: int = 0) -> Workload:
    """The standard chat trace (``pagedkv.trace``) as a workload: its
    prompts cut into 16-token blocks, each distinct (prefix, block) an id;
    requests arrive 1 ms apart and decode ``decode_steps`` tokens."""
    from pagedkv.trace import AddRequest, TraceConfig, standard_trace

    config = TraceConfig(num_requests=num_requests, seed=seed)
    size = config.block_size
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    requests: list[TraceRequest] = []
    for step in standard_trace(config):
        if not isinstance(step, AddRequest):
            continue
        tokens = step.prompt_token_ids
        parent = -1
        block_ids: list[int] = []
        for start in range(0, len(tokens), size):
            key = (parent, tokens[start:start + size])
            parent = ids.setdefault(key, len(ids))
            block_ids.append(parent)
        requests.append(TraceRequest(float(len(requests)), len(tokens), config.decode_steps,
                                     tuple(block_ids)))
    return Workload(f"chat trace ({num_requests} requests)", size, tuple(requests))


def load_workload(path: str, fmt: str = "auto", *, block_tokens: int | None = None,
                  shared_prefix: SharedPrefix | None = None, seed: int = 0) -> Workload:
    """Read ``path`` in ``fmt`` (see :data:`FORMATS`; "auto" picks by the
    file name's extension: ``.csv`` is CSV, anything else JSONL; ``chat``
    ignores ``path`` or reads it as a request count).

    Raises:
        TraceFormatError: malformed input (line and field named).
        InvalidArgumentError: unknown format, missing file.
    """
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "chat" or (fmt == "auto" and path == "chat"):
        count = int(path) if path.isdigit() else 256
        return chat_workload(count, seed)
    if not Path(path).is_file():
        raise InvalidArgumentError(f"TRACE: no such file: {path}")
    if block_tokens is not None and block_tokens < 4:
        raise InvalidArgumentError(f"--trace-block-tokens must be >= 4, got {block_tokens}")
    if fmt == "csv" or (fmt == "auto" and path.lower().endswith(".csv")):
        return read_csv(path, shared_prefix, block_tokens or CSV_BLOCK_TOKENS)
    return read_jsonl(path, fmt, block_tokens)
