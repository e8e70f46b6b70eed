#!/usr/bin/env bash
# Quickstart command 2: install what the tests need (into .venv when not already
# in a virtual environment), then run them.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m accelerator` on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec "$PY" -m pytest "$@"
