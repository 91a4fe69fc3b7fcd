"""The Python grader's sandbox with real processes: results, errors, limits and what the grader cannot
reach (the network, the server's environment and files, processes outliving the call).

Each test's bound on elapsed time is derived from the limits it sets (:func:`deadline`). On a host
where no namespace can be made the sandbox fails closed: those tests are skipped and
:func:`test_fails_closed_without_namespaces` checks the failure instead.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from trainer.graders.sandbox import (
    MAX_SOURCE_BYTES,
    SandboxLimits,
    SandboxOutcome,
    check_python_source,
    run_python_grader,
    run_python_graders,
)

SMALL = SandboxLimits(cpu_seconds=1.0, wall_seconds=4.0, memory_bytes=256 * 2**20)


def _probe() -> SandboxOutcome:
    return run_python_grader("def grade(sample, item):\n    return 1\n", {}, {})


_PROBE = _probe()
AVAILABLE = _PROBE.error != "server"


@pytest.fixture(autouse=True)
def _needs_sandbox(request: pytest.FixtureRequest) -> None:
    """Every test needs the sandbox but the fail-closed one (which needs its absence)."""
    if not AVAILABLE and not request.node.name.startswith("test_fails_closed"):
        pytest.skip(f"no sandbox on this host: {_PROBE.details}")


def deadline(limits: SandboxLimits) -> float:
    """The most a call under ``limits`` may take: its wall clock, plus as much again for the two
    interpreters' start and the kill on a loaded box, plus a second."""
    return 2 * limits.wall_seconds + 1.0


def run(
    body: str,
    sample: dict[str, Any] | None = None,
    item: dict[str, Any] | None = None,
    limits: SandboxLimits = SMALL,
) -> SandboxOutcome:
    source = textwrap.dedent(body)
    start = time.monotonic()
    outcome = run_python_grader(source, sample or {}, item or {}, limits)
    assert time.monotonic() - start < deadline(limits)
    return outcome


def test_returns_the_number() -> None:
    outcome = run(
        """
        def grade(sample, item):
            return 0.25 if sample["output_text"] == item["answer"] else 0
        """,
        {"output_text": "4", "output_json": 4},
        {"answer": "4"},
    )
    assert (outcome.value, outcome.error, outcome.details) == (0.25, None, "")
    assert outcome.seconds > 0
    assert run("def grade(sample, item):\n    return 3\n").value == 3.0


def test_numpy_is_allowed() -> None:
    pytest.importorskip("numpy")
    outcome = run(
        """
        import numpy as np
        def grade(sample, item):
            return np.mean(np.array([1.0, 2.0])) + np.int64(1)
        """
    )
    assert outcome.value == 2.5, outcome


def test_an_exception_is_a_runtime_error_with_the_graders_line() -> None:
    outcome = run(
        """
        def grade(sample, item):
            x = 1
            return x / 0
        """
    )
    assert outcome.value is None and outcome.error == "runtime"
    assert outcome.details == "ZeroDivisionError: division by zero (line 4, in grade: return x / 0)"


@pytest.mark.parametrize(
    ("returned", "details"),
    [
        ("'1.0'", "grade returned str, not a number"),
        ("True", "grade returned bool, not a number"),
        ("None", "grade returned NoneType, not a number"),
        ("float('nan')", "grade returned nan, not a finite number"),
        ("10**400", "grade returned int: OverflowError"),
    ],
)
def test_a_non_number_is_invalid(returned: str, details: str) -> None:
    outcome = run(f"def grade(sample, item):\n    return {returned}\n")
    assert outcome.value is None and outcome.error == "invalid"
    assert outcome.details.startswith(details), outcome.details


@pytest.mark.parametrize("exit_call", ["raise SystemExit(0)", "import os; os._exit(0)"])
def test_exiting_is_a_runtime_error(exit_call: str) -> None:
    outcome = run(f"def grade(sample, item):\n    {exit_call}\n")
    assert outcome.value is None and outcome.error == "runtime"


@pytest.mark.slow
def test_a_cpu_loop_is_stopped_by_its_cpu_limit() -> None:
    limits = SandboxLimits(cpu_seconds=1.0, wall_seconds=5.0)
    outcome = run("def grade(sample, item):\n    while True:\n        pass\n", limits=limits)
    assert outcome.error == "timeout"
    assert outcome.details == "timed out after 1 s of CPU time"
    assert outcome.seconds < limits.wall_seconds


@pytest.mark.slow
def test_a_sleep_is_stopped_by_the_wall_clock() -> None:
    limits = SandboxLimits(cpu_seconds=2.0, wall_seconds=1.5)
    outcome = run("import time\ndef grade(sample, item):\n    time.sleep(1000)\n", limits=limits)
    assert outcome.error == "timeout"
    assert outcome.details == "timed out after 1.5 s (wall)"
    assert limits.wall_seconds <= outcome.seconds < deadline(limits)


def test_a_memory_bomb_is_a_memory_error() -> None:
    outcome = run("def grade(sample, item):\n    return len(bytearray(2**30))\n")
    assert outcome.error == "runtime"
    assert outcome.details.startswith("MemoryError"), outcome.details


def test_a_memory_bomb_at_import_is_a_memory_error() -> None:
    outcome = run("x = [0] * 2**30\ndef grade(sample, item):\n    return 1\n")
    assert outcome.error == "runtime" and outcome.details.startswith("MemoryError")


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_fork_bomb_is_contained_and_leaves_no_process() -> None:
    token = secrets.token_hex(8)
    outcome = run(
        f"""
        import os
        def grade(sample, item):
            while True:
                if os.fork() == 0:
                    os.execv("/bin/sleep", ["sleep", "1000", "{token}"])
        """,
    )
    assert outcome.error == "runtime"
    assert outcome.details.startswith("BlockingIOError"), outcome.details
    assert _processes_with(token) == []


@pytest.mark.slow
def test_a_detached_fork_loop_dies_with_the_call() -> None:
    token = secrets.token_hex(8)
    limits = SandboxLimits(cpu_seconds=1.0, wall_seconds=2.0)
    outcome = run(
        f"""
        import os, time
        def grade(sample, item):
            if os.fork() == 0:
                os.setsid()
                os.execv("/bin/sleep", ["sleep", "1000", "{token}"])
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        """,
        limits=limits,
    )
    assert outcome.error == "timeout"
    assert _processes_with(token) == []


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def test_no_tcp_connection_reaches_the_host(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    outcome = run(
        """
        import socket
        def grade(sample, item):
            try:
                socket.create_connection(("127.0.0.1", item["port"]), timeout=1).close()
            except OSError:
                return 0.0
            return 1.0
        """,
        item={"port": port},
    )
    assert outcome.value == 0.0, outcome
    unhandled = run(
        "import socket\ndef grade(sample, item):\n    socket.create_connection(('127.0.0.1', item['port']))\n",
        item={"port": port},
    )
    assert unhandled.error == "runtime"
    assert "Network is unreachable" in unhandled.details or "refused" in unhandled.details
    with pytest.raises(BlockingIOError):
        listener.accept()


def test_the_servers_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZENFLOW_SECRET_TEST", secrets.token_hex(8))
    outcome = run(
        """
        import glob, os
        def grade(sample, item):
            seen = "ZENFLOW_SECRET_TEST" in os.environ
            for path in glob.glob("/proc/*/environ"):
                try:
                    seen = seen or b"ZENFLOW_SECRET_TEST" in open(path, "rb").read()
                except OSError:
                    pass
            return 1.0 if seen else 0.0
        """
    )
    assert outcome.value == 0.0, outcome
    env = run("import os\ndef grade(sample, item):\n    raise ValueError(sorted(os.environ))\n")
    assert not any(name.startswith("ZENFLOW") for name in eval(env.details.split(": ", 1)[1].split(" (")[0]))


def test_the_servers_files_are_not_visible(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    here = Path(__file__).resolve()
    outcome = run(
        """
        import os
        def grade(sample, item):
            for path in item["paths"]:
                try:
                    open(path).read()
                    return 1.0
                except OSError:
                    pass
            return 0.0
        """,
        item={"paths": [str(secret), str(here), "/proc/self/environ", "/etc/passwd", "/root/.bashrc"]},
    )
    assert outcome.value == 0.0, outcome


def test_its_cwd_is_a_private_empty_tmp_and_its_root_a_small_read_only_view() -> None:
    outcome = run(
        """
        import os
        def grade(sample, item):
            open("scratch.txt", "w").write("ok")
            try:
                open("/usr/evil", "w")
                return -1.0
            except OSError:
                pass
            raise ValueError(os.getcwd(), sorted(os.listdir(".")), sorted(os.listdir("/")))
        """
    )
    assert outcome.error == "runtime"
    cwd, listing, root = eval(outcome.details.split(": ", 1)[1].split(" (line")[0])
    assert (cwd, listing) == ("/tmp", ["scratch.txt"])
    assert not {"proc", "home", "work", "sys", "run", "var"} & set(root)


def test_print_spam_does_not_break_the_parent() -> None:
    outcome = run(
        """
        import sys
        def grade(sample, item):
            for _ in range(50):
                print("x" * 2**20)
                sys.stderr.write("y" * 2**20)
            return 1.0
        """
    )
    assert outcome.value == 1.0, outcome


def test_a_result_over_the_output_cap_is_an_error() -> None:
    limits = SandboxLimits(cpu_seconds=1.0, wall_seconds=4.0, output_bytes=1024)
    outcome = run(
        "import os\ndef grade(sample, item):\n    os.write(3, b'x' * 4096)\n    return 1\n", limits=limits
    )
    assert outcome.error == "runtime" and "exceeds 1024 bytes" in outcome.details


def test_a_thread_left_running_does_not_hold_the_call() -> None:
    outcome = run(
        """
        import threading, time
        def grade(sample, item):
            threading.Thread(target=time.sleep, args=(1000,)).start()
            return 1.0
        """
    )
    assert outcome.value == 1.0 and outcome.seconds < SMALL.wall_seconds


def test_concurrent_calls_from_threads() -> None:
    source = "def grade(sample, item):\n    return item['n'] * 2\n"
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda n: run_python_grader(source, {}, {"n": n}, SMALL), range(8)))
    assert [o.value for o in outcomes] == [n * 2.0 for n in range(8)]
    batch = run_python_graders(source, [({}, {"n": n}) for n in range(6)], SMALL, max_workers=3)
    assert [o.value for o in batch] == [n * 2.0 for n in range(6)]


def test_an_oversized_source_is_refused_without_a_process() -> None:
    source = "def grade(sample, item):\n    return 1\n" + "#" * MAX_SOURCE_BYTES
    outcome = run_python_grader(source, {}, {})
    assert outcome.error == "invalid" and outcome.seconds == 0.0
    assert check_python_source(source) == f"python grader: source exceeds {MAX_SOURCE_BYTES} bytes"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def grade(sample, item):\n    return 1\n", None),
        ("def grade(sample, item, *rest):\n    return 1\n", None),
        (
            "def grade(sample):\n    return 1\n",
            "python grader: grade must take two parameters: grade(sample, item)",
        ),
        (
            "def grade(a, b):\n  return 1\n x\n",
            "python grader: SyntaxError at line 3: unindent does not match any outer indentation level",
        ),
        ("grade = 3\n", "python grader: source does not define grade(sample, item)"),
        (
            "import nosuchmodule\n",
            "python grader: ModuleNotFoundError: No module named 'nosuchmodule' (line 1, in <module>: import nosuchmodule)",
        ),
    ],
)
def test_check_python_source(source: str, message: str | None) -> None:
    assert check_python_source(source, SMALL) == message


@pytest.mark.slow
def test_check_stops_a_module_that_loops() -> None:
    limits = SandboxLimits(cpu_seconds=1.0, wall_seconds=3.0)
    start = time.monotonic()
    message = check_python_source("while True:\n    pass\n", limits)
    assert message == "python grader: timed out after 1 s of CPU time"
    assert time.monotonic() - start < deadline(limits)


@pytest.mark.skipif(AVAILABLE, reason="namespaces can be made here")
def test_fails_closed_without_namespaces() -> None:
    assert _PROBE.error == "server" and _PROBE.value is None
    assert _PROBE.details == "sandbox_unavailable"


def test_server_tmp_is_removed() -> None:
    tmp = tempfile.gettempdir()
    before = {p for p in os.listdir(tmp) if p.startswith("zenflow-grader-")}
    run("def grade(sample, item):\n    open('f', 'w').write('x')\n    return 1\n")
    after = {p for p in os.listdir(tmp) if p.startswith("zenflow-grader-")}
    assert after <= before
