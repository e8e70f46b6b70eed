#!/usr/bin/env bash
# Installs what the tests and the demo need into the current Python, once.
# torch is installed only when missing: a GPU machine keeps its CUDA build, and a
# fresh CPU machine gets torch==2.13.0 (an unpinned `torch` would pull CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,demo]"
