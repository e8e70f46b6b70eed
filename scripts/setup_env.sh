#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/demo.sh: installs what the tests and the
# demo need, once, and sets PY to the Python that has it.
#
# Outside a virtual (or conda) environment a stock Debian/Ubuntu python3 refuses
# `pip install` (PEP 668, externally-managed-environment), so we create `.venv`
# in the checkout and use it. It sees the system's packages, so a GPU machine's
# CUDA build of torch is kept; torch==2.13.0 (CPU) is installed only when no torch
# is importable at all (an unpinned `torch` would pull multi-GB CUDA wheels).
set -euo pipefail
PY=${PYTHON:-python3}
_in_env='import os, sys; sys.exit(0 if sys.prefix != sys.base_prefix or os.environ.get("CONDA_PREFIX") else 1)'
if ! "$PY" -c "$_in_env"; then
    if [ ! -x .venv/bin/python ]; then
        echo "setup: creating a virtual environment in $PWD/.venv (it sees the system's packages)" >&2
        "$PY" -m venv --system-site-packages .venv || {
            echo "setup: could not create .venv; on Debian/Ubuntu: apt-get install python3-venv" >&2
            exit 1
        }
    fi
    # what `source .venv/bin/activate` does: console scripts (fsdp-ckpt) on PATH too
    export VIRTUAL_ENV=$PWD/.venv PATH=$PWD/.venv/bin:$PATH
    PY=$PWD/.venv/bin/python
    echo "setup: using $PWD/.venv; for fsdp-ckpt and the packages in a new shell: source $PWD/.venv/bin/activate" >&2
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,demo,lint]"
export PY
