"""pytest plugin for running vLLM's own ``tests/v1/core`` (``make verify-vllm``).

Loaded with ``-p vllm_core_plugin`` (``tools/`` on ``PYTHONPATH``) together
with ``--noconftest``: vLLM's top-level ``tests/conftest.py`` pulls in the
model-test machinery, which needs weights and a GPU. This plugin provides the
two fixtures the core tests use instead, and:

- with ``PAGEDKV_SWAP=1``, replaces ``vllm.v1.core.kv_cache_manager.KVCacheManager``
  with ``pagedkv.vllm.KVCacheManager`` before any test module is imported, and
  in every already-imported module that bound the name (the schedulers);
- with ``PAGEDKV_RESULTS=path``, writes the outcome counts per test file there
  as JSON (``{file: {"passed": n, "failed": n, "skipped": n, "error": n}}``),
  plus the node ids of the tests that did not pass (``"_failures"``).

It runs inside vLLM's virtual environment, not pagedkv's: nothing in the
pagedkv packages imports it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_failures: list[str] = []


def _swap_manager() -> None:
    """Make every name bound to vLLM's manager class point at pagedkv's."""
    import vllm.v1.core.kv_cache_manager as vllm_manager_module

    # Import the schedulers first so that they bind the name before the swap
    # and are then rebound below, whichever way they imported it.
    import vllm.v1.core.sched.async_scheduler  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401

    import pagedkv.vllm

    original = vllm_manager_module.KVCacheManager
    replacement = pagedkv.vllm.KVCacheManager
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                setattr(module, name, replacement)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PAGEDKV_SWAP") == "1":
        _swap_manager()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    if report.when == "call":
        _counts[path][report.outcome] += 1
        if report.outcome == "failed":
            _failures.append(report.nodeid)
    elif report.outcome == "failed":  # setup or teardown error
        _counts[path]["error"] += 1
        _failures.append(report.nodeid)
    elif report.outcome == "skipped" and report.when == "setup":
        _counts[path]["skipped"] += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _counts[report.nodeid.split("::", 1)[0]]["error"] += 1
        _failures.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("PAGEDKV_RESULTS")
    if not path:
        return
    data: dict[str, Any] = {file: dict(counts) for file, counts in _counts.items()}
    data["_failures"] = _failures
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let vLLM's logger propagate to the root logger for the test's duration."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate: None,
                caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` that sees vLLM's INFO records."""
    with caplog.at_level(logging.INFO):
        yield caplog
