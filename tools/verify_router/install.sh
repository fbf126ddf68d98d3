#!/usr/bin/env bash
# Builds (or reuses) the venv holding NVIDIA Dynamo's KV indexer for `make verify-router`,
# outside the checkout: ai-dynamo-runtime is one ~75 MB wheel (~280 MB installed) that imports
# without CUDA. pagedkv itself runs in the project's .venv; only `python -m dynamo.indexer`
# runs from this venv.
set -euo pipefail
VENV="${ROUTER_VENV:-$HOME/.cache/pagedkv/router-venv}"
PYTHON="${PYTHON:-python3}"
DYNAMO_VERSION="${DYNAMO_VERSION:-1.6.1}"
STAMP="$VENV/.pagedkv-router-installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$DYNAMO_VERSION" ]; then
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "ai-dynamo-runtime==$DYNAMO_VERSION"
"$VENV/bin/python" -c "import dynamo.indexer, dynamo.llm" \
  || { echo "verify-router: ai-dynamo-runtime installed but dynamo.indexer does not import" >&2; exit 1; }
echo "$DYNAMO_VERSION" > "$STAMP"
