"""The Python grader's sandbox: untrusted ``grade(sample, item)`` code run in a fresh process per call.

Each call starts the interpreter on :mod:`.sandbox_child`, which makes the process its own network,
mount, PID, IPC and UTS namespaces (and a user namespace), a root of its own with no ``/proc``,
``/home`` or server files, a private ``/tmp``, an empty environment, ``nobody`` when the server is
root, and the rlimits of :class:`SandboxLimits`; then :mod:`.sandbox_runner` runs the user's code there.
The request goes in and the result comes out through files (no pipe to deadlock on); the result is
read up to :attr:`SandboxLimits.output_bytes`. Whatever the code does, the caller gets a
:class:`SandboxOutcome`, never an exception. Threat model and limits: docs/graders.md, "The Python
grader's sandbox".
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from trainer.graders.sandbox_child import EXIT_CPU, EXIT_SERVER

#: Importable in the sandbox besides the standard library, when the server's environment has them.
ALLOWED_PACKAGES = ("numpy",)
#: The largest grader source accepted.
MAX_SOURCE_BYTES = 256 * 2**10
#: Host paths the sandbox sees read-only (when they exist): the system's programs and libraries.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
PACKAGES_DIR = "/pkgs"

log = logging.getLogger(__name__)
ErrorKind = Literal["runtime", "timeout", "server", "invalid"]
#: The errors a stage reports in its result (the others the parent finds itself).
_REPORTED: dict[str, ErrorKind] = {"runtime": "runtime", "invalid": "invalid", "server": "server"}
_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SandboxLimits:
    """The bounds of one grader call (each process of it: CPU, memory and file size; all of them
    together: the process count and the wall clock)."""

    cpu_seconds: float = 10.0
    wall_seconds: float = 30.0
    memory_bytes: int = 512 * 2**20
    #: The result the parent reads back; the grader's prints go to /dev/null.
    output_bytes: int = 64 * 2**10
    #: Processes and threads of the grader at once (RLIMIT_NPROC in its own user namespace).
    max_processes: int = 16
    #: The largest file it may write, and its private /tmp's size.
    file_bytes: int = 16 * 2**20
    open_files: int = 64
    #: Run without namespaces where the kernel allows none (no network isolation, no private root):
    #: for trusted graders only. Off: such a host fails every call with ``sandbox_unavailable``.
    allow_unisolated: bool = False


@dataclass(frozen=True)
class SandboxOutcome:
    """What a grader call gave: the number, or the error and a user-safe message."""

    #: The JSON-decoded return value (a finite float), or None.
    value: Any
    error: ErrorKind | None
    details: str
    seconds: float


def _base_python() -> str:
    """The interpreter itself (a virtual environment's ``python`` is a link to it)."""
    return os.path.realpath(sys.executable)


def _covered(path: str, dirs: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _package_dirs() -> list[tuple[str, str]]:
    """(host folder, sandbox folder) of each allowed package found, with its wheel's bundled libraries."""
    found: list[tuple[str, str]] = []
    for name in ALLOWED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = Path(next(iter(spec.submodule_search_locations))).resolve()
        for path in (folder, folder.with_name(f"{name}.libs")):
            if path.is_dir():
                found.append((str(path), f"{PACKAGES_DIR}/{path.name}"))
    return found


@cache
def sandbox_view() -> dict[str, Any]:
    """What the sandbox's root holds: binds of the system folders, the interpreter's prefix and the
    allowed packages; the loader's cache; a few devices; the prefix's site-packages masked."""
    dirs: list[tuple[str, str]] = []
    symlinks: list[tuple[str, str]] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            symlinks.append((os.readlink(d), d))
        elif os.path.isdir(d):
            dirs.append((d, d))
    real_dirs = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)]
    prefix = os.path.realpath(sys.base_prefix)
    if not _covered(prefix, real_dirs):
        dirs.append((prefix, prefix))
    site = sysconfig.get_path("purelib", vars={"base": prefix, "platbase": prefix})
    return {
        "dirs": dirs + _package_dirs(),
        "files": [(f, f) for f in SYSTEM_FILES if os.path.isfile(f)],
        "devices": [d for d in DEVICES if os.path.exists(d)],
        "symlinks": symlinks,
        "masks": [os.path.realpath(site)],
    }


def _config(root: str, limits: SandboxLimits) -> str:
    return json.dumps(
        {
            "python": _base_python(),
            "runner": str(_HERE / "sandbox_runner.py"),
            "root": root,
            "view": sandbox_view(),
            "limits": asdict(limits),
            "allow_unisolated": limits.allow_unisolated,
        }
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait(proc: subprocess.Popen[bytes], wall_seconds: float) -> bool:
    """Whether the wall clock ran out (then the whole process group is killed; the first stage's death
    takes the sandbox's PID namespace with it)."""
    try:
        proc.wait(timeout=wall_seconds)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return True
    return False


def _spawn(tmp: str, request: bytes, limits: SandboxLimits) -> tuple[int | None, bytes]:
    """Run the two stages in ``tmp``: the exit code (None at the wall deadline) and the result bytes."""
    root = os.path.join(tmp, "root")
    os.mkdir(root, 0o700)
    in_path, out_path = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
    Path(in_path).write_bytes(request)
    argv = [_base_python(), "-I", "-S", str(_HERE / "sandbox_child.py"), _config(root, limits)]
    with open(in_path, "rb") as stdin, open(out_path, "w+b") as stdout:
        proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.DEVNULL,
            env={},
            cwd=tmp,
            close_fds=True,
            start_new_session=True,
        )
        timed_out = _wait(proc, limits.wall_seconds)
        stdout.seek(0)
        return (None if timed_out else proc.returncode), stdout.read(limits.output_bytes + 1)


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(float(value))


def _from_result(result: Any) -> tuple[Any, ErrorKind | None, str]:
    if not isinstance(result, dict):
        return None, "runtime", "the grader's result is malformed"
    if "error" in result:
        return None, _REPORTED.get(str(result["error"]), "runtime"), str(result.get("details", ""))[:600]
    if "ok" in result:
        return None, None, ""
    if _finite_number(result.get("value")):
        return float(result["value"]), None, ""
    return None, "invalid", "grade did not return a finite number"


def _from_exit(code: int, limits: SandboxLimits) -> tuple[Any, ErrorKind | None, str]:
    """The outcome of a run that wrote no result."""
    if code == EXIT_CPU:
        return None, "timeout", f"timed out after {limits.cpu_seconds:g} s of CPU time"
    if code > 128:
        name = signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else code - 128
        return None, "runtime", f"the grader process was killed ({name}; memory or process limits?)"
    return None, "runtime", f"the grader process exited (code {code}) without a result"


def decode(code: int | None, raw: bytes, limits: SandboxLimits) -> tuple[Any, ErrorKind | None, str]:
    """(value, error, details) of a finished run."""
    if code is None:
        return None, "timeout", f"timed out after {limits.wall_seconds:g} s (wall)"
    if len(raw) > limits.output_bytes:
        return None, "runtime", f"the grader's result exceeds {limits.output_bytes} bytes"
    if not raw:
        return _from_exit(code, limits)
    try:
        result = json.loads(raw)
    except ValueError:
        return None, "runtime", "the grader's result is malformed"
    value, error, details = _from_result(result)
    if error == "server" and code != EXIT_SERVER:
        return None, "runtime", details  # only the first stage reports server errors
    return value, error, details


def _server_kind(raw: bytes) -> str:
    try:
        return str(json.loads(raw).get("kind", "sandbox_error"))
    except (ValueError, AttributeError):
        return "sandbox_error"


def _execute(request: dict[str, Any], limits: SandboxLimits) -> SandboxOutcome:
    start = time.monotonic()
    try:
        payload = json.dumps(request, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        log.warning("python grader request not JSON: %s", exc)
        return SandboxOutcome(None, "server", "sample_not_serializable", time.monotonic() - start)
    try:
        with tempfile.TemporaryDirectory(prefix="zenflow-grader-", ignore_cleanup_errors=True) as tmp:
            code, raw = _spawn(tmp, payload, limits)
    except OSError as exc:
        log.warning("python grader sandbox could not start: %s", exc)
        return SandboxOutcome(None, "server", "sandbox_error", time.monotonic() - start)
    value, error, details = decode(code, raw, limits)
    if error == "server":  # the full message (host paths) is the operator's, in the log
        log.warning("python grader sandbox failed: %s", details)
        details = _server_kind(raw)
    return SandboxOutcome(value, error, details, time.monotonic() - start)


def _too_big(source: str) -> bool:
    return len(source.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES


def run_python_grader(
    source: str, sample: dict[str, Any], item: dict[str, Any], limits: SandboxLimits = SandboxLimits()
) -> SandboxOutcome:
    """``grade(sample, item)`` of ``source``, in a fresh sandboxed process (thread-safe)."""
    if _too_big(source):
        return SandboxOutcome(None, "invalid", f"source exceeds {MAX_SOURCE_BYTES} bytes", 0.0)
    return _execute({"op": "grade", "source": source, "sample": sample, "item": item}, limits)


def run_python_graders(
    source: str,
    pairs: Iterable[tuple[dict[str, Any], dict[str, Any]]],
    limits: SandboxLimits = SandboxLimits(),
    max_workers: int = 4,
) -> list[SandboxOutcome]:
    """:func:`run_python_grader` on each (sample, item), at most ``max_workers`` at once, in order."""
    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        return list(pool.map(lambda pair: run_python_grader(source, pair[0], pair[1], limits), pairs))


def check_python_source(source: str, limits: SandboxLimits = SandboxLimits()) -> str | None:
    """None when ``source`` compiles and defines ``grade(sample, item)`` (checked in the sandbox: its
    module is user code), else the message for the user."""
    if _too_big(source):
        return f"python grader: source exceeds {MAX_SOURCE_BYTES} bytes"
    outcome = _execute({"op": "check", "source": source}, limits)
    if outcome.error is None:
        return None
    if outcome.error == "server":
        return f"python grader: could not be checked ({outcome.details})"
    return f"python grader: {outcome.details}"
