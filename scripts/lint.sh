#!/usr/bin/env bash
# Every static check, as `make test` runs them: lint and format (ruff), the import contracts
# ([tool.importlinter] in pyproject.toml) and types ([tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-logo
.venv/bin/mypy
