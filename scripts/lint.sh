#!/usr/bin/env bash
# The code gates CI runs before the tests: ruff (lint + format) and mypy, as
# configured in pyproject.toml. Installs what it needs first (scripts/setup_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
