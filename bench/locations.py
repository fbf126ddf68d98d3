"""Where the bench tools find what lies outside the checkout: vLLM's venv and the Mooncake traces.

``make vllm-venv`` (tools/vllm_venv/install.sh) builds vLLM 0.33 on CPU in a
virtual environment of its own, outside the checkout: at ``$VLLM_VENV``, by
default ``~/.cache/pagedkv/vllm-venv``. Every side-by-side tool reads its
interpreter from here, so one setting moves them all; ``$VLLM_PYTHON`` names an
interpreter directly and wins over both.

The Mooncake traces (kvcache-ai/Mooncake FAST25-release) are not committed:
``$PAGEDKV_TRACES`` names their folder, else ``../shared/traces`` beside the
checkout is used where it exists (CI has it). A tool or test that needs a
trace and finds none leaves its rows out or skips, naming this variable.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "pagedkv" / "vllm-venv"
"""Where ``make vllm-venv`` builds the venv when ``$VLLM_VENV`` is not set (same default as the Makefile)."""

SHARED_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
"""The traces' folder beside the checkout, used when ``$PAGEDKV_TRACES`` is not set."""

CONVERSATION_TRACE = "mooncake_conversation_trace.jsonl"
SYNTHETIC_TRACE = "mooncake_synthetic_trace.jsonl"


def vllm_venv() -> Path:
    """The vLLM venv: ``$VLLM_VENV``, else :data:`DEFAULT_VLLM_VENV`."""
    return Path(os.environ.get("VLLM_VENV") or DEFAULT_VLLM_VENV)


def vllm_python() -> str:
    """vLLM's interpreter: ``$VLLM_PYTHON``, else the vLLM venv's ``bin/python``."""
    return os.environ.get("VLLM_PYTHON") or str(vllm_venv() / "bin" / "python")


def traces_folder() -> Path:
    """The Mooncake traces' folder: ``$PAGEDKV_TRACES``, else :data:`SHARED_TRACES` (which may not exist)."""
    return Path(os.environ.get("PAGEDKV_TRACES") or SHARED_TRACES)


def mooncake_trace(name: str = CONVERSATION_TRACE) -> Path:
    """The path of one Mooncake trace file in :func:`traces_folder` (it may not exist)."""
    return traces_folder() / name
