"""Where the tools find what lies outside the checkout, and that no tracked file names one machine's paths.

``bench/locations.py`` is the one place the benchmarks read vLLM's venv and the Mooncake traces
from; the Makefile (``make vllm-venv``, ``make verify-vllm``) and ``tools/verify_vllm.py`` (which
runs on any Python, outside the packages) name the same default venv and are held to it here.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import locations

REPO = Path(__file__).resolve().parent.parent


def test_vllm_python_prefers_vllm_python_then_vllm_venv_then_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PYTHON", "/opt/x/bin/python3")
    monkeypatch.setenv("VLLM_VENV", "/opt/venv")
    assert locations.vllm_python() == "/opt/x/bin/python3"
    monkeypatch.delenv("VLLM_PYTHON")
    assert locations.vllm_python() == str(Path("/opt/venv") / "bin" / "python")
    monkeypatch.delenv("VLLM_VENV")
    assert locations.vllm_venv() == Path.home() / ".cache" / "pagedkv" / "vllm-venv"
    assert locations.vllm_python() == str(locations.DEFAULT_VLLM_VENV / "bin" / "python")
    monkeypatch.setenv("VLLM_VENV", "")  # set but empty: the default, not the current directory
    assert locations.vllm_venv() == locations.DEFAULT_VLLM_VENV


def test_traces_come_from_pagedkv_traces_else_beside_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_TRACES", "/data/mooncake")
    assert locations.mooncake_trace() == Path("/data/mooncake") / "mooncake_conversation_trace.jsonl"
    assert locations.mooncake_trace(locations.SYNTHETIC_TRACE).name == "mooncake_synthetic_trace.jsonl"
    monkeypatch.delenv("PAGEDKV_TRACES")
    assert locations.traces_folder() == REPO.parent / "shared" / "traces"


def test_makefile_and_verify_vllm_name_the_same_default_venv() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    match = re.search(r"^VLLM_VENV \?= \$\(HOME\)/(\S+)$", makefile, re.M)
    assert match is not None, "the Makefile's VLLM_VENV default is not under $(HOME)"
    assert Path.home() / match.group(1) == locations.DEFAULT_VLLM_VENV
    spec = importlib.util.spec_from_file_location("verify_vllm", REPO / "tools" / "verify_vllm.py")
    assert spec is not None and spec.loader is not None
    verify_vllm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verify_vllm)
    assert verify_vllm.DEFAULT_VLLM_VENV == locations.DEFAULT_VLLM_VENV


# This project's machine paths, spelled so that this file does not contain them.
MACHINE_PATH = re.compile("/" + "(?:work|root)" + "/")


def test_no_tracked_file_names_a_path_of_one_machine() -> None:
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run([git, "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    found = []
    for name in filter(None, listed.decode("utf-8").split("\0")):
        path = REPO / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "absolute paths of one machine in tracked files:\n" + "\n".join(found)
