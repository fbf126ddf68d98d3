"""Fault injection into manager operations (the machinery of
``test_fault_injection``).

A fixed engine script (admissions with prefix hits and external tokens,
decode with lookahead, delayed caching, preemption, eviction, prefix-cache
resets, events, statistics) runs on a small configuration of each attention
type. For the operation under test, the script is replayed from scratch up
to it, then the operation runs with a fault armed:

- *asynchronous*: ``sys.settrace`` raises ``KeyboardInterrupt`` or
  ``MemoryError`` at the k-th line event executed in pagedkv's own code.
  Afterwards ``check_invariants()`` must hold, every request the manager
  knows must be freeable, and freeing them all must give back every block
  (spec/operations.md, "Exception safety").
- *engine*: the k-th attribute read on the request object raises (an
  engine's property getter failing). Afterwards the state must be exactly as
  before: the operation is all-or-nothing.

``python -m tests.faults [all]`` prints the tally per operation.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import Any

from pagedkv.spec.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.spec.mamba_spec import MambaSpec
from tests.implementations import IMPLEMENTATIONS

__all__ = ["CONFIGS", "OPERATIONS", "Result", "run_async_faults", "run_engine_faults"]


def _full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 8, "float16")


def _mamba(mode: str) -> MambaSpec:
    return MambaSpec(4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode=mode, num_speculative_blocks=1)


#: name -> (group specs, manager keyword arguments); small pools so that
#: the script evicts cached blocks and sees refusals.
CONFIGS: dict[str, tuple[tuple[KVCacheSpec, ...], dict[str, Any]]] = {
    "full": ((_full(),), {}),
    "full_no_caching": ((_full(), _full()), {"enable_caching": False}),
    "full_eagle_events": ((_full(2),), {"use_eagle": True, "enable_kv_cache_events": True, "log_stats": True,
                                        "num_blocks": 20}),
    "sliding_window": ((SlidingWindowSpec(4, 1, 8, "float16", sliding_window=5),), {}),
    "chunked_local": ((ChunkedLocalAttentionSpec(4, 1, 8, "float16", attention_chunk_size=8),), {}),
    "mamba_all": ((_full(), _mamba("all")), {"num_blocks": 22}),
    "mamba_align": ((_full(), _mamba("align")), {"num_blocks": 18}),
    "mamba_none": ((_full(), _mamba("none")), {"num_blocks": 18}),
    "cross_attention": ((_full(), CrossAttentionSpec(4, 1, 8, "float16")), {"num_blocks": 18}),
    "sink": ((SinkFullAttentionSpec(4, 1, 8, "float16", sink_len=4),), {}),
    "hybrid": ((_full(4), SlidingWindowSpec(2, 1, 8, "float16", sliding_window=3),
                ChunkedLocalAttentionSpec(4, 1, 8, "float16", attention_chunk_size=4)),
               {"enable_kv_cache_events": True, "num_blocks": 34}),
}
NUM_BLOCKS = 14
MAX_MODEL_LEN = 40
ENCODER_TOKENS = 6
PREFIX = [5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8]


class Engine:
    """One manager, its requests, and what the engine knows about them."""

    def __init__(self, impl: ModuleType, config_name: str) -> None:
        specs, kwargs = CONFIGS[config_name]
        kwargs = dict(kwargs)
        num_blocks = kwargs.pop("num_blocks", NUM_BLOCKS)
        groups = tuple(KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs))
        self.manager = impl.KVCacheManager(KVCacheConfig(num_blocks, (), groups), MAX_MODEL_LEN, **kwargs)
        self.encoder = ENCODER_TOKENS if any(isinstance(s, CrossAttentionSpec) for s in specs) else 0
        self.baseline_free = self.manager.block_pool.get_num_free_blocks()
        # Requests the engine believes running (kept by the engine: asking
        # the manager inside a traced operation would trace the question).
        self.running: set[str] = set()
        make = self.manager.make_request
        self.requests = {
            "a": make("a", PREFIX + [1, 2, 3]),
            "b": make("b", PREFIX + [4, 5]),
            "c": make("c", [9] * 21),
            "d": make("d", PREFIX + [6, 6, 6, 6, 6]),
        }

    def admit(self, name: str, wrap: Callable[[Any], Any], *, external: int = 0, delay: bool = False,
              chunk: int | None = None, lookahead: int = 1) -> None:
        request = self.requests[name]
        # Only allocate_slots is wrapped: each call is all-or-nothing on its
        # own (get_computed_blocks is tried alone, below).
        hit, num_hit = self.manager.get_computed_blocks(request)
        external = max(0, min(external, request.num_tokens - num_hit - 1))
        remaining = request.num_tokens - num_hit - external
        new = remaining if chunk is None else min(chunk, remaining)
        if self.manager.allocate_slots(wrap(request), new, num_hit, hit, num_lookahead_tokens=lookahead,
                                       num_external_computed_tokens=external, delay_cache_blocks=delay,
                                       num_encoder_tokens=self.encoder) is not None:
            request.num_computed_tokens = num_hit + external + new
            self.running.add(name)

    def decode(self, name: str, wrap: Callable[[Any], Any]) -> None:
        request = self.requests[name]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids([1, 2])
        new = request.num_tokens - request.num_computed_tokens
        if self.manager.allocate_slots(wrap(request), new, num_lookahead_tokens=2) is not None:
            request.num_computed_tokens += new

    def free(self, name: str, wrap: Callable[[Any], Any]) -> None:
        request = self.requests[name]
        if name not in self.running:
            return
        self.manager.free(wrap(request))
        self.running.discard(name)
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def known(self) -> list[str]:
        return [r.request_id for r in self.manager.snapshot().requests]


Wrap = Callable[[Any], Any]
#: (label, operation): the script, in order. Labels name the manager call exercised.
OPERATIONS: list[tuple[str, Callable[[Engine, Wrap], None]]] = [
    ("allocate_slots:admit", lambda e, w: e.admit("a", w)),
    ("allocate_slots:decode", lambda e, w: e.decode("a", w)),
    ("new_step_starts", lambda e, w: e.manager.new_step_starts()),
    ("allocate_slots:admit_hit", lambda e, w: e.admit("b", w, chunk=14)),
    ("free", lambda e, w: e.free("a", w)),
    ("allocate_slots:admit_delayed_evicting", lambda e, w: e.admit("c", w, delay=True)),
    ("cache_blocks", lambda e, w: e.manager.cache_blocks(w(e.requests["c"]), e.requests["c"].num_computed_tokens)
        if "c" in e.running else None),
    ("allocate_slots:decode_second", lambda e, w: e.decode("b", w)),
    ("evict_blocks", lambda e, w: e.manager.evict_blocks([1, 2, 3, 5, 8])),
    ("free:preempt", lambda e, w: e.free("c", w)),
    ("allocate_slots:admit_hit_external", lambda e, w: e.admit("d", w, external=3)),
    ("reset_prefix_cache:refused", lambda e, w: e.manager.reset_prefix_cache()),
    ("get_computed_blocks", lambda e, w: e.manager.get_computed_blocks(w(e.requests["a"]))),
    ("free:second", lambda e, w: e.free("b", w)),
    ("take_events", lambda e, w: e.manager.take_events()),
    ("make_prefix_cache_stats", lambda e, w: e.manager.make_prefix_cache_stats()),
    ("free:last", lambda e, w: e.free("d", w)),
    ("reset_prefix_cache", lambda e, w: e.manager.reset_prefix_cache()),
    # Without lookahead: the admission fast path of one full-attention group (D-PERF-17).
    ("allocate_slots:admit_plain", lambda e, w: e.admit("a", w, lookahead=0)),
    ("free:plain", lambda e, w: e.free("a", w)),
    ("allocate_slots:admit_plain_hit", lambda e, w: e.admit("b", w, lookahead=0)),
]


def _identity(request: Any) -> Any:
    return request


_PACKAGE_MARK = os.sep + "pagedkv" + os.sep
_TENSOR_MARK = os.sep + "tensor" + os.sep


def _ours(filename: str) -> bool:
    return _PACKAGE_MARK in filename and _TENSOR_MARK not in filename


class LineFuse:
    """A tracer counting line events in pagedkv's code; raises ``fault`` at
    line event number ``fire_at`` (1-based; 0 never fires)."""

    def __init__(self, fire_at: int, fault: type[BaseException]) -> None:
        self.fire_at = fire_at
        self.fault = fault
        self.count = 0

    def global_trace(self, frame: FrameType, event: str, arg: object) -> Any:
        if _ours(frame.f_code.co_filename):
            return self.local_trace
        return None

    def local_trace(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            self.count += 1
            if self.count == self.fire_at:
                raise self.fault(f"injected at line event {self.count}")
        return self.local_trace


def _counting(request: Any, counter: list[int]) -> FlakyRequest:
    """A request that counts its attribute reads and never fails."""
    return FlakyRequest(request, counter, 0)


class EngineFault(Exception):
    """Raised by an engine's request object (not a pagedkv error)."""


class FlakyRequest:
    """Forwards every attribute to a request; the ``fire_at``-th read raises."""

    def __init__(self, inner: Any, counter: list[int], fire_at: int) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_counter", counter)
        object.__setattr__(self, "_fire_at", fire_at)

    def __getattr__(self, name: str) -> Any:
        counter = object.__getattribute__(self, "_counter")
        counter[0] += 1
        if counter[0] == object.__getattribute__(self, "_fire_at"):
            raise EngineFault(f"request attribute {name!r} failed")
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_inner"), name, value)


@dataclass
class Result:
    """Per operation label: injection points tried, and failures (a message each)."""

    points: dict[str, int] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)

    def add(self, label: str, failure: str | None) -> None:
        self.points[label] = self.points.get(label, 0) + 1
        if failure is not None:
            self.failures.setdefault(label, []).append(failure)

    @property
    def num_failures(self) -> int:
        return sum(len(v) for v in self.failures.values())


def _replay(impl: ModuleType, config_name: str, upto: int) -> Engine:
    engine = Engine(impl, config_name)
    for _, operation in OPERATIONS[:upto]:
        operation(engine, _identity)
    return engine


class Runaway(Exception):
    """A check ran past its line budget (a corrupted linked list loops)."""


class LineBudget:
    """A tracer that stops the traced code after ``budget`` line events."""

    def __init__(self, budget: int) -> None:
        self.left = budget

    def global_trace(self, frame: FrameType, event: str, arg: object) -> Any:
        return self.local_trace

    def local_trace(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise Runaway("the check ran away (a cycle in a corrupted structure?)")
        return self.local_trace


def _consistency_failure(engine: Engine) -> str | None:
    """Why the manager is not consistent after a fault (None when it is).
    Runs under a line budget: a corrupted free list may be cyclic, and
    walking it must not eat the machine's memory."""
    budget = LineBudget(300_000)
    sys.settrace(budget.global_trace)
    try:
        return _check_consistency(engine)
    except Runaway as error:
        return str(error)
    finally:
        sys.settrace(None)


def _check_consistency(engine: Engine) -> str | None:
    manager = engine.manager
    try:
        manager.check_invariants()
        for request_id in engine.known():
            manager.free(engine.requests[request_id])
        manager.check_invariants()
        if engine.known():
            return f"requests still known after freeing all: {engine.known()}"
        free = manager.block_pool.get_num_free_blocks()
        if free != engine.baseline_free:
            return f"leaked {engine.baseline_free - free} blocks"
    except Runaway:
        raise
    except Exception as error:  # noqa: BLE001 - any failure here is a corrupted state
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return None


def _count_lines(impl: ModuleType, config_name: str, index: int) -> int:
    engine = _replay(impl, config_name, index)
    fuse = LineFuse(0, KeyboardInterrupt)
    sys.settrace(fuse.global_trace)
    try:
        OPERATIONS[index][1](engine, _identity)
    finally:
        sys.settrace(None)
    return fuse.count


def selected(points: int, index: int, stride: int) -> list[int]:
    """The line events tried (1-based): every one with stride 1, else a
    deterministic spread that always includes the first and the last."""
    if stride <= 1 or points <= 2:
        return list(range(1, points + 1))
    chosen = set(range(1 + index % stride, points + 1, stride))
    chosen.update((1, points))
    return sorted(chosen)


def run_async_faults(impl_name: str, config_name: str, stride: int = 1) -> Result:
    """Inject at the selected line events of every operation of the script."""
    impl = IMPLEMENTATIONS[impl_name]
    result = Result()
    for index, (label, operation) in enumerate(OPERATIONS):
        total = _count_lines(impl, config_name, index)
        for fire_at in selected(total, index, stride):
            engine = _replay(impl, config_name, index)
            fault = KeyboardInterrupt if fire_at % 2 else MemoryError
            fuse = LineFuse(fire_at, fault)
            sys.settrace(fuse.global_trace)
            try:
                operation(engine, _identity)
            except (KeyboardInterrupt, MemoryError):
                pass
            finally:
                sys.settrace(None)
            failure = _consistency_failure(engine)
            result.add(label, None if failure is None else f"line event {fire_at}/{total}: {failure}")
    return result


def run_engine_faults(impl_name: str, config_name: str) -> Result:
    """Fail each request attribute read of every operation in turn."""
    impl = IMPLEMENTATIONS[impl_name]
    result = Result()
    for index, (label, operation) in enumerate(OPERATIONS):
        counter = [0]
        engine = _replay(impl, config_name, index)
        operation(engine, functools.partial(_counting, counter=counter))
        for fire_at in range(1, counter[0] + 1):
            engine = _replay(impl, config_name, index)
            tries = [0]
            failure = None
            before: list[Any] = []

            def wrap(request: Any, engine: Engine = engine, before: list[Any] = before,
                     tries: list[int] = tries, fire_at: int = fire_at) -> FlakyRequest:
                # The state just before the call that gets the flaky request.
                before[:] = [engine.manager.snapshot()]
                return FlakyRequest(request, tries, fire_at)
            try:
                operation(engine, wrap)
                failure = "the fault did not surface"
            except EngineFault:
                if engine.manager.snapshot() != before[0]:
                    failure = "state changed"
                else:
                    failure = _consistency_failure(engine)
            result.add(label, None if failure is None else f"attribute read {fire_at}: {failure}")
    return result


if __name__ == "__main__":
    stride = 1 if sys.argv[1:] == ["all"] else 7
    for impl_name in IMPLEMENTATIONS:
        totals: dict[str, list[int]] = {}
        engine_totals: dict[str, list[int]] = {}
        for config_name in CONFIGS:
            for result, into in ((run_async_faults(impl_name, config_name, stride), totals),
                                 (run_engine_faults(impl_name, config_name), engine_totals)):
                for label, points in result.points.items():
                    entry = into.setdefault(label.split(":")[0], [0, 0])
                    entry[0] += len(result.failures.get(label, []))
                    entry[1] += points
        print(f"== {impl_name} (stride {stride})")
        for label, (bad, points) in totals.items():
            print(f"  async  {label:24s} corrupted {bad:5d} / {points:5d}")
        for label, (bad, points) in engine_totals.items():
            print(f"  engine {label:24s} not all-or-nothing {bad:5d} / {points:5d}")
