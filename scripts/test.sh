#!/usr/bin/env bash
# The test suite against the real local PostgreSQL and Redis (started by .ci/run in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
