#!/usr/bin/env bash
# The test suite against the real local PostgreSQL and Redis (started by .ci/run in CI), after the
# static checks of scripts/lint.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/lint.sh
exec .venv/bin/python -m pytest "$@"
