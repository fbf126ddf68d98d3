#!/usr/bin/env bash
# Builds (or reuses) vLLM 0.33's CPU-importable venv for `make verify-vllm` and
# `make bench BENCH_ARGS=--vllm`, outside the checkout, at $VLLM_VENV
# (default: ~/.cache/pagedkv/vllm-venv). About 3 GB.
#
# vLLM 0.33.0's wheel pins a CUDA torch, so it is installed with --no-deps and its
# run-time imports are installed by name (requirements.txt beside this script), within
# the version bounds vLLM declares.
# The constraints file keeps torch on the CPU build 2.13.0 (never a CUDA build); the
# CPU wheel lives on PyTorch's CPU index (TORCH_CPU_INDEX), which is tried only when
# the configured indexes do not have it. Only vLLM's KV-cache core and its tests run
# here: no GPU, no model weights.
set -euo pipefail
VENV="${VLLM_VENV:-$HOME/.cache/pagedkv/vllm-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
HERE="$(cd "$(dirname "$0")" && pwd)"
STAMP="$VENV/.pagedkv-vllm-installed"
# Bumped when the steps or the package lists change: an older venv is brought up to date.
INSTALL_VERSION=1
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INSTALL_VERSION" ]; then
  exit 0
fi
start=$(date +%s)
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
CONS="$HERE/constraints.txt"
"${PIP[@]}" install -q --upgrade pip setuptools wheel packaging
if ! "${PIP[@]}" install -q -c "$CONS" 'torch==2.13.0+cpu'; then
  echo "torch 2.13.0+cpu is not on the configured package indexes; trying $TORCH_CPU_INDEX"
  "${PIP[@]}" install -q -c "$CONS" --extra-index-url "$TORCH_CPU_INDEX" 'torch==2.13.0+cpu'
fi
"${PIP[@]}" install -q --no-deps 'vllm==0.33.0'
# vLLM's own version bounds (its wheel's Requires-Dist) as constraints on what requirements.txt
# installs, torch's family left to constraints.txt: the packages vLLM was released against.
VLLM_CONS="$VENV/vllm-constraints.txt"
"$VENV/bin/python" - "$VLLM_CONS" <<'PY'
import importlib.metadata
import sys

from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for text in importlib.metadata.requires("vllm") or []:
    requirement = Requirement(text)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue  # an optional extra's, or another platform's
    if requirement.name.lower() in TORCH_FAMILY or not str(requirement.specifier):
        continue
    lines.append(f"{requirement.name}{requirement.specifier}")
with open(sys.argv[1], "w", encoding="utf-8") as out:
    out.write("\n".join(sorted(lines)) + "\n")
PY
echo "installing vLLM's CPU-side imports; pip then lists vLLM's GPU-only requirements (CUDA kernels,"
echo "torchvision, ...) and its torch pin as unmet: expected, nothing here imports them"
"${PIP[@]}" install -q -c "$CONS" -c "$VLLM_CONS" -r "$HERE/requirements.txt"
"$VENV/bin/python" - <<'PY'
import torch
assert "+cpu" in torch.__version__, f"vLLM venv holds a non-CPU torch: {torch.__version__}"
import vllm
assert vllm.__version__ == "0.33.0", vllm.__version__
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401  (fails loudly if broken)
import pytest, hypothesis  # noqa: F401  (make verify-vllm runs vLLM's tests with them)
print("vLLM venv ok: vllm", vllm.__version__, "torch", torch.__version__)
PY
echo "$INSTALL_VERSION" > "$STAMP"
end=$(date +%s)
echo "vLLM venv built at $VENV in $((end - start)) s; size: $(du -sh "$VENV" | cut -f1)"
