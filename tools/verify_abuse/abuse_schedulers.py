"""Scheduler variants the abuse check serves with (`--scheduler-cls abuse_schedulers.NAME`).

Each is vLLM's scheduler (stock) or pagedkv's, with a probe that watches the pool from inside the
engine process and writes what it saw to the JSON file named by `PAGEDKV_ABUSE_STATE`:
- at every idle point (no request left in the scheduler), the pool's free-block count read from
  the manager's own counters (pagedkv: the core pool's; stock: vLLM's block pool), the requests the
  manager still knows, the references still held, and for pagedkv its `check_invariants()`;
- the status each aborted request had when the abort arrived (waiting, preempted, running);
- each `reset_prefix_cache` and whether it succeeded;
- a series of (time, used blocks, running, waiting) sampled at most every `SAMPLE_S` seconds.

- StockProbe / PagedkvProbe: the two engines compared.
- PagedkvLeaky: the negative control. pagedkv's scheduler that, on the first abort of a request
  holding blocks, takes one more reference on one of its blocks and never drops it: one block
  leaks. The check must fail on it.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler as StockScheduler
from vllm.v1.request import RequestStatus

SAMPLE_S = 0.25


class _Probe:
    """Mixed into a scheduler: records the pool's state (see the module docstring)."""

    LABEL = "?"
    # Methods the scheduler class provides (declared for the mixin's readers).
    kv_cache_manager: Any
    requests: dict[str, Any]
    running: list[Any]
    waiting: Any

    def _probe_start(self) -> None:
        self._probe_path = os.environ.get("PAGEDKV_ABUSE_STATE", "")
        self._probe: dict[str, Any] = {
            "label": self.LABEL,
            "started_at": time.time(),  # the series' times are seconds after this (wall clock)
            "manager": f"{type(self.kv_cache_manager).__module__}.{type(self.kv_cache_manager).__qualname__}",
            "num_blocks": self._probe_num_blocks(),
            "aborted_by_status": Counter(),
            "resets": Counter(),
            "steps": 0,
            "max_used": 0,
            "idle_points": 0,
            "idle": None,
            "series": [],
        }
        self._probe_last_sample = 0.0
        self._probe_t0 = time.monotonic()
        self._probe_write()

    # ------------------------------------------------------------- readings

    def _probe_num_blocks(self) -> int:
        return int(self.kv_cache_manager.block_pool.num_gpu_blocks)

    def _probe_free_blocks(self) -> int:
        """The manager's own free count (pagedkv: its core pool's, not the vLLM-facing view)."""
        core = getattr(self.kv_cache_manager, "_core", None)
        pool = core.block_pool if core is not None else self.kv_cache_manager.block_pool
        return int(pool.get_num_free_blocks())

    def _probe_used_blocks(self) -> int:
        # The null block (id 0) is never free: a drained pool has num_blocks - 1 free.
        return self._probe_num_blocks() - 1 - self._probe_free_blocks()

    def _probe_held(self) -> dict[str, Any]:
        """Requests the manager still knows and references it still counts, at idle."""
        manager = self.kv_cache_manager
        core = getattr(manager, "_core", None)
        if core is not None:  # pagedkv
            coordinator = core.coordinator
            pool = core.block_pool
            held = {
                "known_requests": len(coordinator.requests),
                "request_tables": sum(len(m.req_to_blocks) for m in coordinator.managers),
                "referenced_blocks": sum(1 for r in pool.ref_counts[1:] if r),
            }
            try:
                core.check_invariants()
                held["invariants"] = "ok"
            except Exception as exc:  # the message names the broken invariant
                held["invariants"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            return held
        managers = manager.coordinator.single_type_managers
        return {
            "known_requests": len({r for m in managers for r in m.req_to_blocks}),
            "request_tables": sum(len(m.req_to_blocks) for m in managers),
            "referenced_blocks": sum(1 for b in manager.block_pool.blocks[1:] if b.ref_cnt),
            "invariants": "n/a (stock)",
        }

    # ------------------------------------------------------------ recording

    def _probe_write(self) -> None:
        if not self._probe_path:
            return
        tmp = f"{self._probe_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self._probe, f)
        os.replace(tmp, self._probe_path)

    def _probe_after(self) -> None:
        used = self._probe_used_blocks()
        probe = self._probe
        probe["max_used"] = max(probe["max_used"], used)
        now = time.monotonic()
        idle = not self.requests
        if idle:
            probe["idle_points"] += 1
            probe["idle"] = {"t": now - self._probe_t0, "free_blocks": self._probe_free_blocks(), "used_blocks": used,
                             **self._probe_held()}
        if idle or now - self._probe_last_sample >= SAMPLE_S:
            self._probe_last_sample = now
            # What keeps the scheduler busy, for a drain that does not come.
            probe["pending"] = [[rid, r.status.name] for rid, r in list(self.requests.items())[:8]]
            probe["writes"] = probe.get("writes", 0) + 1
            probe["series"].append([round(now - self._probe_t0, 3), used, len(self.running), len(self.waiting)])
            self._probe_write()


def _probed(base: type) -> type:
    """`base` (a vLLM scheduler class) with the probe hooked into its entry points."""

    class Probed(_Probe, base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._probe_start()

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            self._probe["steps"] += 1
            return super().schedule(*args, **kwargs)

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            result = super().update_from_output(*args, **kwargs)
            self._probe_after()
            return result

        def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
            if finished_status == RequestStatus.FINISHED_ABORTED:
                ids = (request_ids,) if isinstance(request_ids, str) else list(request_ids or ())
                for rid in ids:
                    request = self.requests.get(rid)
                    if request is not None and not request.is_finished():
                        self._probe["aborted_by_status"][request.status.name] += 1
                        self._probe_on_abort(request)
            result = super().finish_requests(request_ids, finished_status)
            self._probe_after()
            return result

        def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
            ok = super().reset_prefix_cache(*args, **kwargs)
            forced = bool(kwargs.get("reset_running_requests") or (args and args[0]))
            self._probe["resets"][f"{'forced ' if forced else ''}{'ok' if ok else 'refused'}"] += 1
            self._probe_after()
            return ok

        def _probe_on_abort(self, request: Any) -> None:
            """Hook for the negative control; the compared engines do nothing here."""

    return Probed


class StockProbe(_probed(StockScheduler)):  # type: ignore[misc]
    LABEL = "stock"


def _make_pagedkv_variants() -> dict[str, type]:
    """Built on first use, so the stock variant imports where pagedkv.vllm does not."""
    from pagedkv.vllm import Scheduler as PagedkvScheduler

    class PagedkvProbe(_probed(PagedkvScheduler)):  # type: ignore[misc]
        LABEL = "pagedkv"

    class PagedkvLeaky(PagedkvProbe):
        """The deliberate bug: one block of the first aborted request that holds any is
        referenced once more and never released, so the pool cannot drain."""

        LABEL = "pagedkv-leaky"
        _leaked = False

        def _probe_on_abort(self, request: Any) -> None:
            # Only a running request is sure to hold blocks the manager knows.
            if self._leaked or request.status != RequestStatus.RUNNING:
                return
            ids = [b for group in self.kv_cache_manager.get_block_ids(request.request_id) for b in group if b]
            if ids:
                self.kv_cache_manager._core.block_pool.touch(ids[:1])
                self._leaked = True
                self._probe["planted_leak"] = ids[0]

    for cls in (PagedkvProbe, PagedkvLeaky):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {"PagedkvProbe": PagedkvProbe, "PagedkvLeaky": PagedkvLeaky}


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name in ("PagedkvProbe", "PagedkvLeaky"):
        if not _LAZY:
            _LAZY.update(_make_pagedkv_variants())
        return _LAZY[name]
    raise AttributeError(name)

