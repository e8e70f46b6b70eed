#!/usr/bin/env bash
# Quickstart command 1: install what the demo needs (into .venv when not already
# in a virtual environment), then run it end to end.
# Extra arguments go to scripts/demo.py (e.g. `--quick`, `--steps 60`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec "$PY" scripts/demo.py "$@"
