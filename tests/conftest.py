"""Shared fixtures: a private PostgreSQL database per test session (tables from the ORM models), the
local Redis broker, and service settings pointing at them.

PostgreSQL: ``postgresql+psycopg://postgres@127.0.0.1:5432`` (trust auth); a database with a random
name is created for the session and dropped after, so parallel runs never collide. Redis:
``redis://127.0.0.1:6379/0``; tests isolate themselves with unique queue names. Override with
ZENFLOW_TEST_POSTGRES_URL / ZENFLOW_TEST_REDIS_URL. A missing service skips locally and fails in CI
(tests/support.py).

Two tiers. ``make test`` (what CI runs) runs everything. ``make test-fast`` (scripts/test-fast.sh, the
inner loop: under 2 minutes on 2 cores) runs ``-m "not services and not slow"``: the unit tests of every
package, in this process, with no service reached or started and no rank or script spawned (those are
``slow``). A test is ``services`` when it needs PostgreSQL or Redis, or starts a server or a process of
the service (a Celery worker, uvicorn, Prometheus, nginx, a browser, a job runner or worker process).
:func:`pytest_collection_modifyitems` marks every test that requests one of :data:`SERVICE_FIXTURES`
(directly or through another fixture), so a new test on those fixtures cannot slip into the fast tier; a
test that reaches a service another way carries ``pytest.mark.services`` itself (its module's
``pytestmark``). test-fast runs with the service URLs pointing at a closed port and
``ZENFLOW_TEST_NO_SERVICES=1``, under which tests/support.py's service helpers fail the test ("mark it
services") instead of connecting.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import database_with_schema, require_redis

#: Fixtures that reach PostgreSQL or Redis or start service processes: a test requesting any of them
#: (through other fixtures too: pytest's closure) is marked ``services`` and left out of test-fast.
SERVICE_FIXTURES = frozenset(
    {
        # here
        "pg_db_url",
        "redis_broker_url",
        "service_env",
        "unique_queue",
        # tests/api/conftest.py: the API on the session database and Redis
        "pg_url",
        "redis_url",
        "queue_name",
        "app",
        "client",
        "team",
        "other_team",
        # fixtures of test modules that start the service's processes or a browser
        "celery_worker",  # tests/e2e/test_full_flow.py
        "live_server",  # tests/console/test_console.py
        "browser",
        "workers",  # tests/worker/test_worker.py
        "service",  # tests/faults/test_bad_input.py
    }
)


#: Seconds each test module took in ``make test`` on the 2-core CI box (all of its tests, under the
#: xdist workers), which orders the modules longest first; refreshed with ``--record-module-durations``.
MODULE_DURATIONS = Path(__file__).with_name("module_durations.json")
#: A module not in MODULE_DURATIONS is estimated from its tests' tiers: (slow, services, plain) seconds.
TEST_SECONDS_BY_TIER = (30.0, 1.0, 0.05)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-module-durations",
        action="store_true",
        help=f"write each test module's total duration of this run into {MODULE_DURATIONS.name}",
    )


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _recorded() -> dict[str, float]:
    return json.loads(MODULE_DURATIONS.read_text()) if MODULE_DURATIONS.is_file() else {}


def _tier(item: pytest.Item) -> int:
    return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("services") else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``services`` every test that requests a :data:`SERVICE_FIXTURES` fixture; then order the
    modules longest first (:data:`MODULE_DURATIONS`, else an estimate from their tests' tiers), each
    module's tests in their order. Under pytest-xdist (``--dist loadfile --no-loadscope-reorder``: a
    module per worker at a time, in this order) the long modules start early and the run ends on short
    ones, not waiting on one long module while the other workers idle."""
    for item in items:
        if SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.services)
    recorded = _recorded()
    estimate: dict[str, float] = {}
    for item in items:
        module = _module(item.nodeid)
        estimate[module] = estimate.get(module, 0.0) + TEST_SECONDS_BY_TIER[_tier(item)]
    seconds = {module: recorded.get(module, guess) for module, guess in estimate.items()}
    items.sort(key=lambda item: -seconds[_module(item.nodeid)])


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum each module's setup, call and teardown times (in the xdist controller too: workers send it
    their reports)."""
    module = _module(report.nodeid)
    _durations[module] = _durations.get(module, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("--record-module-durations") or hasattr(config, "workerinput"):
        return  # asked for, and only in the controller (or a run without workers)
    recorded = _recorded()
    recorded.update({module: round(s, 1) for module, s in _durations.items()})
    MODULE_DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


@pytest.fixture(scope="session")
def pg_db_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL database with all store.orm tables (create_all), for this session."""
    from store.db import get_engine

    with database_with_schema("zf_test") as url:
        yield url
    get_engine.cache_clear()


@pytest.fixture(scope="session")
def redis_broker_url() -> str:
    """The local Redis, checked reachable."""
    return require_redis()


@pytest.fixture
def unique_queue(redis_broker_url: str) -> Iterator[str]:
    """A queue name no one else uses; its Redis keys are deleted afterwards."""
    import redis

    name = f"zf-test-{secrets.token_hex(6)}"
    yield name
    r = redis.Redis.from_url(redis_broker_url)
    for key in r.scan_iter(f"*{name}*"):
        r.delete(key)


@pytest.fixture
def service_env(pg_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """ZENFLOW_* environment for the session database and a private data dir (settings cache cleared)."""
    from store.settings import get_settings

    env = {
        "ZENFLOW_DATABASE_URL": pg_db_url,
        "ZENFLOW_DATA_DIR": str(tmp_path / "var"),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def torch_single_thread() -> Iterator[None]:
    """One intra-op thread for tiny models: on a loaded 2-core machine OpenMP spinning otherwise
    makes a 64-wide matmul take milliseconds. Restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
