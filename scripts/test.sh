#!/usr/bin/env bash
# Quickstart command 2: install what the tests need, then run them.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m cuda` on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m pytest "$@"
