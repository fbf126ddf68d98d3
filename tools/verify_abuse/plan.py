"""The abuse workload: a seeded list of HTTP calls, each with what the client does with it.

The same seed gives the same calls, bodies and client actions on every engine, so stock vLLM and
pagedkv meet the same workload. Timing (which request is waiting or preempted when its client
goes away) is the engine's; what the client does is fixed here.

Phases, in order (each a list of calls; the load phases are sent concurrently):
- `bad`: malformed or out-of-range requests, one at a time at idle; each must get a 4xx.
- `features`: n > 1, best_of, stop strings and stop token ids, the same X-Request-Id on requests
  in flight together (one of each pair disconnected), a chat request with no chat template.
- `load`: a concurrent mix of streams: completed, disconnected at once, after the response
  headers (a long prompt is still in chunked prefill), after k tokens (mid-decode), or once the
  stream stalls (the request is waiting or preempted); the bad requests again, under load; and
  `POST /reset_prefix_cache`, plain and with `reset_running_requests`, while requests run.
- `burst`: requests worth 4x the pool's capacity sent at once, some disconnected.
- `after` (once the load drained): the prompts of disconnected requests again, to completion
  (a block written by an aborted request must not be hit wrongly); then `probe`: the prefix
  cache reset at idle and a fixed set of prompts twice, one at a time (hits compared with stock).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

LOW_ID, HIGH_ID = 3, 1023  # token ids 0..2 are the tokenizer's specials
VOCAB = 1024
MODEL = "<model>"  # replaced by the served model's name when sent

# What the client does with a call.
COMPLETE = "complete"  # read the whole response
CLOSE_AT_ONCE = "close-at-once"  # send the request, close the connection without reading
CLOSE_AFTER_HEADERS = "close-after-headers"  # close once the stream's headers arrive
CLOSE_AFTER_TOKENS = "close-after-tokens"  # close after `close_after` streamed chunks
CLOSE_WHEN_STALLED = "close-when-stalled"  # close when no chunk comes for STALL_S (or at close_after)
ABORTING = (CLOSE_AT_ONCE, CLOSE_AFTER_HEADERS, CLOSE_AFTER_TOKENS, CLOSE_WHEN_STALLED)
STALL_S = 0.4


@dataclass(frozen=True)
class Call:
    """One HTTP request of the workload."""

    name: str
    phase: str
    kind: str  # what it exercises, e.g. "bad/prompt over max_model_len"
    path: str = "/v1/completions"
    body: dict[str, Any] | None = None
    raw: bytes | None = None  # sent as is instead of `body` (malformed JSON)
    headers: dict[str, str] = field(default_factory=dict)
    query: str = ""
    action: str = COMPLETE
    close_after: int = 0
    # "ok": 200 expected; "4xx": a refusal expected; "any": 200 or 4xx, recorded (best_of).
    expect: str = "ok"
    # Greedy and completed: its output is compared with the clean stock run.
    compare: bool = False
    client: str = "raw"  # "raw" (http.client) or "openai" (the openai package)

    @property
    def prompt(self) -> list[int] | None:
        p = (self.body or {}).get("prompt")
        return p if isinstance(p, list) and all(isinstance(t, int) for t in p) else None


@dataclass(frozen=True)
class Sizes:
    load: int = 48  # streams in the load phase
    concurrency: int = 12  # client threads in the load phase (above max_num_seqs: a queue forms)
    burst_factor: int = 4  # the burst asks for this many times the pool's capacity in tokens
    probes: int = 6
    seeded: bool = False  # add seeded sampling requests (they crash vLLM 0.32 CPU: feature_calls)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(LOW_ID, HIGH_ID) for _ in range(n)]


def _completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}
    body.update(extra)
    return body


def bad_calls(rng: random.Random, max_model_len: int, phase: str) -> list[Call]:
    """Requests the server must refuse with a 4xx and a message."""
    ok = _tokens(rng, 12)

    def call(kind: str, **kw: Any) -> Call:
        return Call(name=f"{phase}/{kind}", phase=phase, kind=f"bad/{kind}", expect="4xx", **kw)

    return [
        call("prompt of max_model_len, 1 new token", body=_completion(_tokens(rng, max_model_len), 1)),
        call("prompt one token over max_model_len", body=_completion(_tokens(rng, max_model_len + 1), 1)),
        call("prompt 8x max_model_len", body=_completion(_tokens(rng, 8 * max_model_len), 4)),
        call("empty token prompt", body=_completion([], 4)),
        call("empty text prompt", body=_completion("", 4)),  # type: ignore[arg-type]
        call("token id = vocab size", body=_completion([*ok, VOCAB], 4)),
        call("token id far out of vocab", body=_completion([*ok, 10 * VOCAB + 7], 4)),
        call("negative token id", body=_completion([*ok, -1], 4)),
        call("max_tokens 0", body=_completion(ok, 0)),
        call("max_tokens -1", body=_completion(ok, -1)),
        call("temperature -1", body=_completion(ok, 4, temperature=-1.0)),
        call("n 0", body=_completion(ok, 4, n=0)),
        call("unknown model", body={**_completion(ok, 4), "model": "no-such-model"}),
        call("malformed JSON", raw=b'{"model": "x", "prompt": [3, 4'),
        call("41 stop strings", body=_completion(ok, 4, stop=[f"t{x}" for x in range(100, 141)])),
        call("prompt of wrong type", body=_completion(ok, 4) | {"prompt": {"a": 1}}),
        call("chat without a chat template", path="/v1/chat/completions",
             body={"model": MODEL, "messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 4}),
    ]


def feature_calls(rng: random.Random, prefixes: list[list[int]], max_model_len: int, seeded: bool) -> list[Call]:
    """Well-formed requests using options beyond plain completion; sent concurrently."""
    calls: list[Call] = []

    def add(kind: str, **kw: Any) -> None:
        calls.append(Call(name=f"features/{len(calls)}-{kind}", phase="features", kind=kind, **kw))

    # n > 1 needs sampling (vLLM refuses it with greedy). A per-request seed would make the
    # samples reproducible, but on vLLM 0.32's CPU build a seeded request whose prefill is split
    # into chunks kills the engine ("CPU Generator does not use offset"), stock or pagedkv alike:
    # `seeded` adds them (and compares their outputs) to show it.
    for i in range(2):
        seed = {"seed": 100 + i} if seeded else {}
        add(f"n=2 (sampling{', seeded' if seeded else ''})",
            body=_completion(rng.choice(prefixes) + _tokens(rng, 20), 12, n=2, temperature=1.0, **seed),
            compare=seeded, client="openai")
    add("n=3 stream, disconnected mid-decode", body=_completion(_tokens(rng, 40), 120, n=3, stream=True,
                                                               temperature=1.0),
        action=CLOSE_AFTER_TOKENS, close_after=6)
    # best_of is not a field of vLLM 0.32's completion request: recorded, whatever the answer.
    add("best_of=3", body=_completion(_tokens(rng, 16), 8, n=1, best_of=3), expect="any")
    add("best_of=2 < n=3", body=_completion(_tokens(rng, 16), 8, n=3, best_of=2, temperature=1.0), expect="any")
    add("max_tokens past max_model_len (vLLM shortens it)",
        body=_completion(_tokens(rng, max_model_len - 8), 16), compare=True)
    for i in range(4):
        # "tNN" also matches inside "tNNx": about 4% of tokens end the request.
        stops = [f"t{x}" for x in rng.sample(range(10, 100), 4)]
        add("stop strings", body=_completion(_tokens(rng, 30), 48, stop=stops), compare=True,
            client="openai" if i % 2 else "raw")
    for _ in range(2):
        stop_ids = rng.sample(range(LOW_ID, VOCAB), 60)
        add("stop token ids", body=_completion(_tokens(rng, 30), 48, stop_token_ids=stop_ids), compare=True)
    for pair in range(2):
        rid = f"abuse-duplicate-{pair}"
        add("same X-Request-Id, completed", body=_completion(_tokens(rng, 50), 40, stream=True),
            headers={"X-Request-Id": rid}, compare=True)
        add("same X-Request-Id, disconnected", body=_completion(_tokens(rng, 50), 120, stream=True),
            headers={"X-Request-Id": rid}, action=CLOSE_AFTER_TOKENS, close_after=3)
    add("same request_id in the body twice", body=_completion(_tokens(rng, 20), 8, request_id="abuse-body-id"),
        compare=True)
    add("same request_id in the body twice", body=_completion(_tokens(rng, 20), 8, request_id="abuse-body-id"),
        compare=True)
    return calls


def _load_call(rng: random.Random, i: int, phase: str, prefixes: list[list[int]], max_model_len: int,
               block_size: int) -> Call:
    roll = rng.random()
    prefix = rng.choice(prefixes) if rng.random() < 0.4 else []
    if roll < 0.45:
        n_prompt = rng.choice([rng.randint(4, 60), rng.randint(60, 200)])
        prompt = (prefix + _tokens(rng, n_prompt))[: max_model_len - 64]
        streamed = rng.random() < 0.5
        return Call(name=f"{phase}/{i}", phase=phase, kind="completed" + (" stream" if streamed else ""),
                    body=_completion(prompt, rng.randint(4, 48), stream=streamed), compare=True,
                    client="openai" if i % 3 == 0 else "raw")
    if roll < 0.55:
        prompt = prefix + _tokens(rng, rng.randint(20, 200))
        return Call(name=f"{phase}/{i}", phase=phase, kind="disconnect before the first token",
                    body=_completion(prompt, 64, stream=True), action=CLOSE_AT_ONCE)
    if roll < 0.67:
        # Long: several chunks of prefill (max_num_batched_tokens is small), full blocks written.
        prompt = (prefix + _tokens(rng, max_model_len))[: max_model_len - 40 - rng.randint(0, block_size)]
        return Call(name=f"{phase}/{i}", phase=phase, kind="disconnect mid-prefill (long prompt)",
                    body=_completion(prompt, 32, stream=True), action=CLOSE_AFTER_HEADERS)
    if roll < 0.85:
        prompt = prefix + _tokens(rng, rng.randint(20, 160))
        sampled = {"n": 2, "temperature": 1.0} if rng.random() < 0.25 else {}
        return Call(name=f"{phase}/{i}", phase=phase, kind=f"disconnect mid-decode{' (n=2)' if sampled else ''}",
                    body=_completion(prompt, 200, stream=True, **sampled), action=CLOSE_AFTER_TOKENS,
                    close_after=rng.randint(1, 12), client="openai" if i % 2 else "raw")
    prompt = prefix + _tokens(rng, rng.randint(60, 200))
    return Call(name=f"{phase}/{i}", phase=phase, kind="disconnect when stalled (waiting or preempted)",
                body=_completion(prompt, 240, stream=True), action=CLOSE_WHEN_STALLED, close_after=150)


def load_calls(rng: random.Random, sizes: Sizes, prefixes: list[list[int]], max_model_len: int,
               block_size: int) -> list[Call]:
    calls = [_load_call(rng, i, "load", prefixes, max_model_len, block_size) for i in range(sizes.load)]
    placer = random.Random(rng.random())
    bad = [replace(c, phase="load") for c in bad_calls(placer, max_model_len, "load-bad")]
    resets = [Call(name=f"load/reset-{j}", phase="load", kind="reset_prefix_cache while requests run",
                   path="/reset_prefix_cache", body={}, query="?reset_running_requests=true" if j % 2 else "")
              for j in range(4)]
    # Spread the bad requests and resets through the load.
    for extra in (*bad, *resets):
        calls.insert(placer.randint(min(4, len(calls)), len(calls)), extra)
    return calls


def burst_calls(rng: random.Random, sizes: Sizes, usable_tokens: int, prefixes: list[list[int]]) -> list[Call]:
    calls: list[Call] = []
    total = 0
    while total < sizes.burst_factor * usable_tokens:
        prompt = rng.choice(prefixes) + _tokens(rng, rng.randint(40, 140))
        max_tokens = rng.randint(24, 72)
        total += len(prompt) + max_tokens
        i = len(calls)
        if i % 5 == 4:
            calls.append(Call(name=f"burst/{i}", phase="burst", kind="burst, disconnected mid-decode",
                              body=_completion(prompt, max_tokens + 100, stream=True), action=CLOSE_AFTER_TOKENS,
                              close_after=2))
        else:
            calls.append(Call(name=f"burst/{i}", phase="burst", kind="burst, completed",
                              body=_completion(prompt, max_tokens, stream=i % 2 == 0), compare=True))
    return calls


def after_calls(aborted: list[Call]) -> list[Call]:
    """The disconnected requests' prompts again, to completion, one at a time."""
    out = []
    for c in aborted:
        prompt = c.prompt
        if prompt is None:
            continue
        out.append(Call(name=f"after/{c.name}", phase="after", kind="prompt of a disconnected request, again",
                        body=_completion(prompt, 8), compare=True))
    return out


def probe_calls(rng: random.Random, sizes: Sizes, prefixes: list[list[int]]) -> list[Call]:
    """A prefix-cache reset at idle, then fixed prompts twice over, one at a time."""
    prompts = [prefixes[i % len(prefixes)] + _tokens(rng, rng.randint(5, 60)) for i in range(sizes.probes)]
    calls = [Call(name="probe/reset at idle", phase="probe", kind="reset_prefix_cache at idle",
                  path="/reset_prefix_cache", body={})]
    for round_ in range(2):
        for j, p in enumerate(prompts):
            calls.append(Call(name=f"probe/{round_}-{j}", phase="probe", kind="probe", body=_completion(p, 6),
                              compare=True))
    return calls


@dataclass
class Workload:
    seed: int
    prefixes: list[list[int]]
    phases: dict[str, list[Call]]


def build(seed: int, sizes: Sizes, max_model_len: int, block_size: int, usable_tokens: int) -> Workload:
    """Every phase but `after`, which depends on which calls the client disconnected."""
    def rng(phase: str) -> random.Random:
        # One generator per phase: a smaller load phase (the negative control's) is a prefix of
        # the full one and changes no other phase.
        return random.Random(f"{seed}/{phase}")

    prefix_rng = rng("prefixes")
    prefixes = [_tokens(prefix_rng, block_size * prefix_rng.randint(2, 4) + prefix_rng.randint(0, 9))
                for _ in range(4)]
    phases = {
        "bad": bad_calls(rng("bad"), max_model_len, "bad"),
        "features": feature_calls(rng("features"), prefixes, max_model_len, sizes.seeded),
        "load": load_calls(rng("load"), sizes, prefixes, max_model_len, block_size),
        "burst": burst_calls(rng("burst"), sizes, usable_tokens, prefixes),
        "probe": probe_calls(rng("probe"), sizes, prefixes),
    }
    return Workload(seed, prefixes, phases)
