#!/usr/bin/env bash
# The inner loop (`make test-fast`): the unit tests of every package, `-m "not services and not slow"`
# (tests/conftest.py), plain pytest, no service reached or started: PostgreSQL and Redis are pointed at
# a closed port and ZENFLOW_TEST_NO_SERVICES=1 makes tests/support.py fail a test that asks for them, so
# a test missing its `services` marker fails here instead of connecting. On ZENFLOW_TEST_WORKERS
# pytest-xdist workers (3), as scripts/test.sh. Arguments go to pytest.
# `make test` (scripts/test.sh) runs everything, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
export ZENFLOW_TEST_NO_SERVICES=1
export ZENFLOW_TEST_POSTGRES_URL="postgresql+psycopg://postgres@127.0.0.1:1/postgres"
export ZENFLOW_TEST_REDIS_URL="redis://127.0.0.1:1/0"
exec .venv/bin/python -m pytest -q -n "${ZENFLOW_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder -m "not services and not slow" "$@"
