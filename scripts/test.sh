#!/usr/bin/env bash
# The test suite against the real local PostgreSQL and Redis (started by .ci/run in CI), after the
# static checks: lint, the import contracts ([tool.importlinter] in pyproject.toml) and types ([tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/lint-imports --no-logo
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
