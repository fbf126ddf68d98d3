"""Smoke tests of the ``pagedkv`` CLI and the demo (a handful of requests)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import pytest

from pagedkv import cli, demo
from pagedkv.trace import make_manager

_READY = all(hasattr(importlib.import_module(f"pagedkv.{name}"), "KVCacheManager")
             for name in ("reference", "optimized"))
needs_managers = pytest.mark.skipif(not _READY, reason="reference/optimized KVCacheManager not there yet")

SMALL = ["--requests", "4", "--num-blocks", "512", "--no-progress"]


@needs_managers
def test_demo_agrees_on_a_few_requests(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "requests served      4" in out
    assert "reference and optimized agreed on" in out
    assert "BlockStored" in out
    # 4 requests share 4 system prompts: no hit at all
    assert "prefix hit rate      0.0%" in out


@needs_managers
@pytest.mark.parametrize("hash_fn", ["xxh3_128", "sha256_cbor"])
def test_demo_hash_functions_and_hits(hash_fn: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--requests", "10", "--num-blocks", "1024", "--no-progress",
                     "--hash-fn", hash_fn]) == 0
    out = capsys.readouterr().out
    assert f"hash {hash_fn}" in out
    assert "prefix hit rate      13.3%" in out  # 2 of 10 requests hit 1024 of 1536 tokens


@needs_managers
def test_demo_without_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", *SMALL, "--no-reference"]) == 0
    assert "reference not run" in capsys.readouterr().out


@needs_managers
def test_demo_reports_a_divergence(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    def skewed(implementation: str, **options: Any) -> Any:
        if implementation == "reference":
            options["num_blocks"] += 1  # a different pool: the snapshots differ at once
        return make_manager(implementation, **options)

    monkeypatch.setattr(demo, "make_manager", skewed)
    assert cli.main(["demo", *SMALL, "--check-every", "1"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGENCE at step 1 " in out
    assert "pool.num_blocks: optimized 512 | reference 513" in out


@needs_managers
def test_demo_reports_a_pool_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--requests", "4", "--num-blocks", "64", "--no-progress"]) == 2
    assert "both managers raised TraceError" in capsys.readouterr().out


@needs_managers
def test_python_m_pagedkv_cli_demo() -> None:
    done = subprocess.run([sys.executable, "-m", "pagedkv.cli", "demo", *SMALL],
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "agreed on" in done.stdout


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out and "plan" in out


def test_unknown_subcommand_is_an_error() -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve"])
    assert exit_info.value.code == 2


def test_plan_passes_its_arguments_through(monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[list[str]] = []

    class FakePlan:
        @staticmethod
        def main(argv: list[str]) -> int:
            received.append(argv)
            return 3

    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: FakePlan if name == "pagedkv.plan" else real_import(name))
    assert cli.main(["plan", "--help", "x"]) == 3
    assert received == [["--help", "x"]]


@needs_managers
@pytest.mark.parametrize("model", ["gemma3", "jamba"])
def test_demo_runs_hybrid_models_in_lockstep(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--model", model, "--requests", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"model {model}" in out and "reference and optimized agreed on" in out
