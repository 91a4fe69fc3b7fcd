#!/usr/bin/env bash
# The test suite against the real local PostgreSQL and Redis (started by .ci/run in CI), after the
# static checks of scripts/lint.sh; on ZENFLOW_TEST_WORKERS pytest-xdist workers (3: most tests wait on
# processes they start, so a 2-core box keeps three busy), a test module per worker at a time (its
# module fixtures are built once), longest modules first (tests/conftest.py's order, which
# --no-loadscope-reorder keeps: xdist would otherwise reorder by test count and start the long
# one-test modules last).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/lint.sh
exec .venv/bin/python -m pytest -n "${ZENFLOW_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
