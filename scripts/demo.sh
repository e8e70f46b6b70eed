#!/usr/bin/env bash
# Quickstart command 1: install what the demo needs, then run it end to end.
# Extra arguments go to scripts/demo.py (e.g. `--quick`, `--steps 60`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" scripts/demo.py "$@"
