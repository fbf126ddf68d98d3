"""Scheduler variants the engine check runs, importable by qualified name (`--scheduler-cls`).

- StockTimed / PagedkvTimed: vLLM's own scheduler and pagedkv's, each with its KV-cache manager
  behind a proxy that adds up the time spent inside the manager's calls and counts scheduler steps.
- PagedkvCorrupt: the negative control. pagedkv's scheduler whose manager hands the model
  runner a wrong block after a prefix hit (see `_corrupt`). The check must catch it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler as StockScheduler

# Totals per process: the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) has one scheduler
# per LLM; the check reads and resets these between workloads through `take_timing(label)`.
_TIMING: dict[str, dict[str, Any]] = {}


def _bucket(label: str) -> dict[str, Any]:
    return _TIMING.setdefault(label, {"steps": 0, "kv_seconds": 0.0, "sched_seconds": 0.0, "calls": Counter(),
                                     "method_seconds": Counter()})


def take_timing(label: str) -> dict[str, Any]:
    """Returns and resets (in place: the proxies hold the bucket) the totals of `label`."""
    b = _bucket(label)
    taken = {"steps": b["steps"], "kv_seconds": b["kv_seconds"], "sched_seconds": b["sched_seconds"],
             "calls": dict(b["calls"]), "method_seconds": dict(b["method_seconds"]),
             "manager": b.get("manager", "")}
    b["steps"], b["kv_seconds"], b["sched_seconds"] = 0, 0.0, 0.0
    b["calls"].clear()
    b["method_seconds"].clear()
    return taken


class _TimedManager:
    """Forwards every attribute to the wrapped manager; times the calls of its methods."""

    def __init__(self, inner: Any, label: str, corrupt_hits: bool = False) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_bucket", _bucket(label))
        # Recorded so the check can assert which manager really served the requests.
        self._bucket["manager"] = f"{type(inner).__module__}.{type(inner).__qualname__}"
        object.__setattr__(self, "_corrupt_hits", corrupt_hits)
        # request id -> tokens hit, for the negative control only
        object.__setattr__(self, "_hits", {})

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value) or name.startswith("__"):
            return value
        bucket = self._bucket
        corrupt = self._corrupt_hits and name in ("get_computed_blocks", "get_blocks")
        hits = self._hits

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = value(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                bucket["kv_seconds"] += dt
                bucket["method_seconds"][name] += dt
                bucket["calls"][name] += 1
            if _TRACE is not None:
                _trace(name, args, kwargs, result)
            if corrupt:
                return _corrupt(name, args, result, hits)
            return result

        return timed

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


# PAGEDKV_ENGINE_TRACE=FILE: every manager call (name, request, result in brief) as JSON lines,
# to find where two engines part ways. Off by default: it costs time.
_TRACE = open(os.environ["PAGEDKV_ENGINE_TRACE"], "w") if os.environ.get("PAGEDKV_ENGINE_TRACE") else None


def _brief(x: Any) -> Any:
    if hasattr(x, "request_id") and hasattr(x, "num_tokens"):
        return f"{x.request_id}[{x.num_computed_tokens}/{x.num_tokens}]"
    if hasattr(x, "get_block_ids"):
        return x.get_block_ids()
    if isinstance(x, (list, tuple)):
        return [_brief(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return type(x).__name__


def _trace(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
    if name.startswith(("take_", "make_", "new_step", "record_prefix")):
        return
    assert _TRACE is not None
    entry = [name, _brief(list(args)), {k: _brief(v) for k, v in kwargs.items()}, _brief(result)]
    _TRACE.write(json.dumps(entry, default=str) + "\n")
    _TRACE.flush()


def _corrupt(name: str, args: tuple[Any, ...], result: Any, hits: dict[str, int]) -> Any:
    """The deliberate bug: after a prefix hit of two or more blocks, the block list the model
    runner gets for the request names the first hit block where the second belongs.

    Swapping two hit blocks would not do: attention over a cached prefix does not depend on
    the order of its keys (their positions are already rotated in). Only the list handed to
    the model runner is wrong; the pool's own lists and reference counts stay as they were,
    so the engine runs on and the difference shows in the tokens.
    """
    if name == "get_computed_blocks":
        hits[args[0].request_id] = int(result[1])
        return result
    request_id = args[0]
    blocks_obj = result
    groups = [list(g) for g in blocks_obj.blocks]
    block_tokens = hits.pop(request_id, 0)
    if not groups or len(groups[0]) < 2 or block_tokens < 64:
        return result
    groups[0][1] = groups[0][0]
    return dataclasses.replace(blocks_obj, blocks=tuple(groups))


def _count_step(label: str) -> None:
    _bucket(label)["steps"] += 1


def _timed_call(label: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Adds the time of one scheduler call (schedule, update_from_output), manager included."""
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        _bucket(label)["sched_seconds"] += time.perf_counter() - t0


class StockTimed(StockScheduler):
    LABEL = "stock"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_cache_manager = _TimedManager(self.kv_cache_manager, self.LABEL)  # type: ignore[assignment]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        _count_step(self.LABEL)
        return _timed_call(self.LABEL, super().schedule, *args, **kwargs)

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        return _timed_call(self.LABEL, super().update_from_output, *args, **kwargs)


def _make_pagedkv_variants() -> dict[str, type]:
    """Built on first use, so the stock variants import where pagedkv.vllm does not."""
    from pagedkv.vllm import Scheduler as PagedkvScheduler

    class PagedkvTimed(PagedkvScheduler):  # type: ignore[misc, valid-type]
        LABEL = "pagedkv"
        CORRUPT = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kv_cache_manager = _TimedManager(self.kv_cache_manager, self.LABEL, self.CORRUPT)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            _count_step(self.LABEL)
            return _timed_call(self.LABEL, super().schedule, *args, **kwargs)

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            return _timed_call(self.LABEL, super().update_from_output, *args, **kwargs)

    class PagedkvCorrupt(PagedkvTimed):
        LABEL = "pagedkv-corrupt"
        CORRUPT = True

    PagedkvTimed.__module__ = PagedkvCorrupt.__module__ = __name__
    PagedkvTimed.__qualname__, PagedkvCorrupt.__qualname__ = "PagedkvTimed", "PagedkvCorrupt"
    return {"PagedkvTimed": PagedkvTimed, "PagedkvCorrupt": PagedkvCorrupt}


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name in ("PagedkvTimed", "PagedkvCorrupt"):
        if not _LAZY:
            _LAZY.update(_make_pagedkv_variants())
        return _LAZY[name]
    raise AttributeError(name)


class StockCorrupt(StockTimed):
    """The same bug in vLLM's own manager: shows the control's teeth before pagedkv exists."""

    LABEL = "stock-corrupt"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        StockScheduler.__init__(self, *args, **kwargs)
        self.kv_cache_manager = _TimedManager(self.kv_cache_manager, self.LABEL, True)  # type: ignore[assignment]


VARIANTS = {
    "stock": "engine_schedulers.StockTimed",
    "pagedkv": "engine_schedulers.PagedkvTimed",
    "pagedkv-corrupt": "engine_schedulers.PagedkvCorrupt",
    "stock-corrupt": "engine_schedulers.StockCorrupt",
}
