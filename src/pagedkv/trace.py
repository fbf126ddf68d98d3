"""The standard chat trace (bench/README.md) and a driver that replays it.

Semantic model: a trace is a deterministic sequence of *steps*, each one thing
an engine does to its KV cache manager (or to a request). The standard chat
trace is::

    8 system prompts of 1024 tokens (vocabulary 32000, random.Random(0))
    256 requests, prompt = system prompt (request i % 8) + 512 unique tokens
    in batches of 64:
        AddRequest                 x64   (make_request: hashes the prompt)
        for each request:
            GetComputedBlocks            (a 1024-token hit, except the first
                                          request of each system prompt)
            AllocateSlots  x1..3         (prefill chunks of <= 512 tokens; the
                                          first chunk passes the hit blocks)
        128 decode steps:
            AppendToken    x64           (one token per request)
            AllocateSlots  x64           (allocate_slots(request, 1))
        Free               x64

With one group of block size 16 that is 33,040 ``allocate_slots`` calls, 256
``get_computed_blocks`` (96-block prompt, 64-block hit) and 256 ``free`` (104
blocks each) -- the trace vLLM 0.33's reference figures in bench/README.md
were measured on.

The steps do not depend on the manager: the generator models the prefix hits
it expects (a system prompt seen before hits in full, nothing else hits) and
:class:`TraceDriver` checks the manager's hit against that expectation, so a
step sequence replays identically against any manager satisfying
``pagedkv.spec.KVCacheManagerLike``.

This module imports only the standard library at run time (``pagedkv.spec``
only for :func:`standard_kv_cache_config` and for typing), so
``bench/vllm_side_by_side.py`` can load it by path in vLLM's interpreter.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

if TYPE_CHECKING:
    from pagedkv.spec import KVCacheConfig, KVCacheManagerLike, Request

__all__ = [
    "TraceConfig", "STANDARD", "AddRequest", "GetComputedBlocks", "AllocateSlots",
    "AppendToken", "Free", "Step", "TraceError", "standard_trace", "peak_blocks",
    "standard_kv_cache_config", "make_manager", "TraceDriver", "CALL_KINDS",
    "MANAGER_CALL_KINDS",
]


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Shape of a chat trace; the defaults are the standard trace of the anchors."""

    num_requests: int = 256
    batch_size: int = 64
    num_system_prompts: int = 8
    system_prompt_tokens: int = 1024
    unique_prompt_tokens: int = 512
    vocab_size: int = 32000
    prefill_chunk: int = 512
    decode_steps: int = 128
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "batch_size", "num_system_prompts", "vocab_size",
                     "prefill_chunk", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"TraceConfig.{name} must be a positive int, got {value!r}")
        for name in ("system_prompt_tokens", "unique_prompt_tokens", "decode_steps"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"TraceConfig.{name} must be a non-negative int, got {value!r}")
        if self.system_prompt_tokens + self.unique_prompt_tokens == 0:
            raise ValueError("TraceConfig: prompts would be empty")

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every prompt."""
        return self.system_prompt_tokens + self.unique_prompt_tokens

    @property
    def max_tokens(self) -> int:
        """Tokens of a request at its end (prompt + decoded)."""
        return self.prompt_tokens + self.decode_steps

    @property
    def expected_hit_tokens(self) -> int:
        """The hit of a request whose system prompt was seen before: the whole
        system prompt's full blocks, capped so the last prompt token is recomputed."""
        bs = self.block_size
        return min(self.system_prompt_tokens // bs, (self.prompt_tokens - 1) // bs) * bs


STANDARD: Final[TraceConfig] = TraceConfig()
"""The standard chat trace (module docstring)."""


# --- steps -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AddRequest:
    """A request arrives: ``manager.make_request(request_id, prompt_token_ids)``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GetComputedBlocks:
    """Prefix-cache lookup; the trace expects ``expected_hit_tokens`` back."""

    request_id: str
    expected_hit_tokens: int


@dataclass(frozen=True, slots=True)
class AllocateSlots:
    """``allocate_slots(request, num_new_tokens, ...)``.

    When ``uses_prefix_hit`` is set (a request's first prefill chunk), the
    driver passes the blocks the request's :class:`GetComputedBlocks` returned
    and ``num_new_computed_tokens`` (== the expected hit). After the call the
    driver advances ``request.num_computed_tokens`` by both counts, as an
    engine does once the step ran.
    """

    request_id: str
    num_new_tokens: int
    num_new_computed_tokens: int = 0
    uses_prefix_hit: bool = False


@dataclass(frozen=True, slots=True)
class AppendToken:
    """The model produced ``token_id``: ``request.append_output_token_ids``."""

    request_id: str
    token_id: int


@dataclass(frozen=True, slots=True)
class Free:
    """The request finished: ``manager.free(request)``."""

    request_id: str


Step: TypeAlias = AddRequest | GetComputedBlocks | AllocateSlots | AppendToken | Free

CALL_KINDS: Final[tuple[str, ...]] = (
    "make_request", "get_computed_blocks", "allocate_slots", "append_token", "free")
"""Timer keys of :class:`TraceDriver`, one per step type."""

MANAGER_CALL_KINDS: Final[tuple[str, ...]] = ("get_computed_blocks", "allocate_slots", "free")
"""The calls whose sum is "manager total on the trace" (as in the anchors:
request creation and token appends are the request's work, not the manager's)."""


class TraceError(RuntimeError):
    """The manager did not behave as the trace assumes (a refused allocation,
    an unexpected prefix hit): the replay cannot go on meaningfully."""


# --- generation --------------------------------------------------------------------

def standard_trace(config: TraceConfig = STANDARD) -> Iterator[Step]:
    """Yield the steps of the chat trace described by ``config``.

    Deterministic: the same config yields the same steps (one
    ``random.Random(config.seed)`` drawn in a fixed order: system prompts,
    then per batch the unique prompt tokens, then the decode tokens).

    Cost: O(total tokens) time; steps are produced lazily.
    """
    rng = random.Random(config.seed)
    vocab = config.vocab_size
    system_prompts = [
        tuple(rng.randrange(vocab) for _ in range(config.system_prompt_tokens))
        for _ in range(config.num_system_prompts)
    ]
    seen_system_prompts: set[int] = set()
    prompt_tokens = config.prompt_tokens
    full_hit = config.expected_hit_tokens
    for batch_start in range(0, config.num_requests, config.batch_size):
        batch = [f"req-{i:05d}" for i in range(
            batch_start, min(batch_start + config.batch_size, config.num_requests))]
        for offset, request_id in enumerate(batch):
            unique = tuple(rng.randrange(vocab) for _ in range(config.unique_prompt_tokens))
            system = system_prompts[(batch_start + offset) % config.num_system_prompts]
            yield AddRequest(request_id, system + unique)
        for offset, request_id in enumerate(batch):
            prompt_index = (batch_start + offset) % config.num_system_prompts
            hit = full_hit if prompt_index in seen_system_prompts else 0
            seen_system_prompts.add(prompt_index)
            yield GetComputedBlocks(request_id, hit)
            computed = hit
            first = True
            while computed < prompt_tokens:
                chunk = min(config.prefill_chunk, prompt_tokens - computed)
                yield AllocateSlots(request_id, chunk, hit if first else 0, uses_prefix_hit=first)
                computed += chunk
                first = False
        for _ in range(config.decode_steps):
            for request_id in batch:
                yield AppendToken(request_id, rng.randrange(vocab))
            for request_id in batch:
                yield AllocateSlots(request_id, 1)
        for request_id in batch:
            yield Free(request_id)


def peak_blocks(config: TraceConfig = STANDARD) -> int:
    """Blocks in use at the end of the largest batch's decode (the null block
    not counted): each request's own blocks plus one copy of each shared
    system-prompt block. A pool needs ``peak_blocks + 1`` blocks to replay
    the trace without a refused allocation."""
    bs = config.block_size
    per_request = -(-config.max_tokens // bs)
    shared = config.expected_hit_tokens // bs
    batch = min(config.batch_size, config.num_requests)
    prompts = min(config.num_system_prompts, batch)
    return batch * (per_request - shared) + prompts * shared


MODELS: dict[str, str] = {
    "llama3": "one group of full-attention layers (the anchors' configuration)",
    "gemma3": "5 sliding-window groups (window 1024) : 1 full-attention group",
    "jamba": "1 full-attention group + 1 Mamba group (state cached at every block, mode 'all')",
}
"""Model shapes the trace can run on, by name."""

DEFAULT_NUM_BLOCKS: dict[str, int] = {"llama3": 8192, "gemma3": 24576, "jamba": 16384}
"""Pool sizes at which the standard trace never runs out of blocks."""


def standard_kv_cache_config(num_blocks: int = 8192, block_size: int = 16,
                             model: str = "llama3") -> KVCacheConfig:
    """The KV cache of ``model`` (see :data:`MODELS`) with ``num_blocks`` blocks
    and no tensors. Attention groups use ``(block_size, 8, 128, "bfloat16")``
    specs; the Mamba group's block size equals ``block_size`` so hits align."""
    from pagedkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
    from pagedkv.spec.kv_cache_spec import SlidingWindowSpec
    from pagedkv.spec.mamba_spec import MambaSpec

    full = FullAttentionSpec(block_size, 8, 128, "bfloat16")
    specs: list[KVCacheSpec]
    if model == "llama3":
        specs = [full]
    elif model == "gemma3":
        specs = [SlidingWindowSpec(block_size, 8, 128, "bfloat16", sliding_window=1024)] * 5 + [full]
    elif model == "jamba":
        specs = [full, MambaSpec(block_size, shapes=((16, 64), (128, 16)), dtypes=("bfloat16", "bfloat16"),
                                 mamba_cache_mode="all")]
    else:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=tuple(KVCacheGroupSpec((f"layer.{index}",), spec) for index, spec in enumerate(specs)),
    )


# --- replay ------------------------------------------------------------------------

class TraceDriver:
    """Replays steps against one manager, as an engine would, timing each call.

    It owns the engine's side: the request objects (made by the manager's
    ``make_request``), the pending prefix hits, and ``num_computed_tokens``,
    advanced after every successful ``allocate_slots``. Only the call itself
    sits between the two ``time.perf_counter_ns()`` reads; ``time_ns[kind]``
    and ``calls[kind]`` accumulate per kind of :data:`CALL_KINDS`.

    Raises:
        TraceError: an allocation was refused, or a hit differed from the trace's
            expectation (the replay stops there).
    """

    def __init__(self, manager: KVCacheManagerLike) -> None:
        self.manager = manager
        self.requests: dict[str, Request] = {}
        self._hits: dict[str, Any] = {}
        self.time_ns: dict[str, int] = dict.fromkeys(CALL_KINDS, 0)
        self.calls: dict[str, int] = dict.fromkeys(CALL_KINDS, 0)
        self.prompt_tokens_hashed = 0
        self.hit_tokens = 0
        self.queried_tokens = 0

    def apply(self, step: Step) -> object:
        """Perform one step; return the manager's (or the request's) raw result:
        a ``Request``, ``(KVCacheBlocks, hit)``, ``KVCacheBlocks`` or ``None``."""
        clock = time.perf_counter_ns  # bound locally: keeps the timed window tight
        manager = self.manager
        kind = type(step)
        if kind is AllocateSlots:
            assert isinstance(step, AllocateSlots)
            request = self.requests[step.request_id]
            if step.uses_prefix_hit:
                hit_blocks = self._hits.pop(step.request_id)
                start = clock()
                result: object = manager.allocate_slots(
                    request, step.num_new_tokens, step.num_new_computed_tokens, hit_blocks)
                elapsed = clock() - start
            else:
                start = clock()
                result = manager.allocate_slots(request, step.num_new_tokens)
                elapsed = clock() - start
            self.time_ns["allocate_slots"] += elapsed
            self.calls["allocate_slots"] += 1
            if result is None:
                raise TraceError(
                    f"allocate_slots({step.request_id!r}, {step.num_new_tokens}) was refused "
                    f"({manager.block_pool.get_num_free_blocks()} free blocks): the pool is too "
                    "small for this trace")
            request.num_computed_tokens += step.num_new_computed_tokens + step.num_new_tokens
            return result
        if kind is AppendToken:
            assert isinstance(step, AppendToken)
            request = self.requests[step.request_id]
            start = clock()
            request.append_output_token_ids(step.token_id)
            self.time_ns["append_token"] += clock() - start
            self.calls["append_token"] += 1
            return None
        if kind is GetComputedBlocks:
            assert isinstance(step, GetComputedBlocks)
            request = self.requests[step.request_id]
            # Each admission is scheduled in a step of its own, as an engine
            # would: a Mamba state cached by an earlier request of the batch
            # may serve this one (untimed: a no-op for attention-only models).
            manager.new_step_starts()
            start = clock()
            looked_up: tuple[Any, int] = manager.get_computed_blocks(request)
            self.time_ns["get_computed_blocks"] += clock() - start
            self.calls["get_computed_blocks"] += 1
            blocks, hit = looked_up
            if hit != step.expected_hit_tokens:
                raise TraceError(
                    f"get_computed_blocks({step.request_id!r}) hit {hit} tokens; the trace "
                    f"expects {step.expected_hit_tokens}")
            self._hits[step.request_id] = blocks
            self.hit_tokens += hit
            self.queried_tokens += request.num_tokens
            return looked_up
        if kind is AddRequest:
            assert isinstance(step, AddRequest)
            prompt = list(step.prompt_token_ids)  # the engine's list, built outside the timer
            start = clock()
            made = manager.make_request(step.request_id, prompt)
            self.time_ns["make_request"] += clock() - start
            self.calls["make_request"] += 1
            self.prompt_tokens_hashed += len(prompt)
            self.requests[step.request_id] = made
            return made
        if kind is Free:
            assert isinstance(step, Free)
            request = self.requests.pop(step.request_id)
            start = clock()
            manager.free(request)
            self.time_ns["free"] += clock() - start
            self.calls["free"] += 1
            return None
        raise TypeError(f"not a trace step: {step!r}")

    def run(self, steps: Iterable[Step]) -> int:
        """Apply every step in order; return how many were applied."""
        count = 0
        apply = self.apply
        for step in steps:
            apply(step)
            count += 1
        return count

    @property
    def manager_total_ns(self) -> int:
        """Time spent in the calls of :data:`MANAGER_CALL_KINDS`."""
        return sum(self.time_ns[kind] for kind in MANAGER_CALL_KINDS)

    def us_per_call(self, kind: str) -> float:
        """Mean microseconds per call of ``kind`` (0.0 when never called)."""
        calls = self.calls[kind]
        return self.time_ns[kind] / calls / 1000 if calls else 0.0


def make_manager(
    implementation: str,
    *,
    num_blocks: int = 8192,
    block_size: int = 16,
    max_model_len: int = 8192,
    model: str = "llama3",
    **options: Any,
) -> KVCacheManagerLike:
    """A ``KVCacheManager`` of ``pagedkv.<implementation>`` ("optimized" or
    "reference") on :func:`standard_kv_cache_config`; ``options`` go to its
    constructor (``hash_fn``, ``enable_caching``, ``log_stats``, ...).

    The class is looked up at call time, so drivers work with whichever
    implementations are installed.
    """
    import importlib

    if implementation not in ("optimized", "reference"):
        raise ValueError(f"implementation must be 'optimized' or 'reference', got {implementation!r}")
    module = importlib.import_module(f"pagedkv.{implementation}")
    manager_class = getattr(module, "KVCacheManager", None)
    if manager_class is None:
        raise ImportError(f"pagedkv.{implementation} has no KVCacheManager yet")
    manager: KVCacheManagerLike = manager_class(
        standard_kv_cache_config(num_blocks, block_size, model), max_model_len, **options)
    return manager
