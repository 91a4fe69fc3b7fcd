"""The process template: a process that imported what a job's ranks and agent import (torch,
transformers, the trainer: seconds of CPU each time a fresh interpreter does it) once, and forks each
rank's ``python -m MODULE ARGS`` from itself, so a rank starts in milliseconds instead (the agent too,
behind :mod:`trainer.run.stand_in`).

A worker starts one (:class:`ProcessTemplate`, in the worker's environment) and names its socket to its
ranks (``ZENFLOW_TEMPLATE_SOCKET``). The process the elastic agent starts for a rank,
:mod:`trainer.run.rank_entry`, then stands in for the rank (:func:`run_forked`) instead of exec'ing a
new interpreter: it sends the command, its environment, working directory, CPU affinity and its stdin,
stdout and stderr (``SCM_RIGHTS``) to the template, which forks a child that takes them on, becomes
its own session and runs the module as ``__main__`` (``runpy``, as ``python -m`` does). The stand-in
forwards every signal it gets to the child and exits as the child did (its code, or killed by the same
signal), so the agent sees the rank as if it had exec'd; the child dies with the template
(``PR_SET_PDEATHSIG``), and the template kills a child whose stand-in has gone (its connection closed:
the agent's SIGKILL, the worker's). Where the template cannot serve (none named, not ready, gone, or a
command that is not ``python -m`` of its own interpreter, an environment that differs from the
template's in more than :data:`PER_RANK_VARS`) the stand-in execs as before.

What a fork keeps from the template that a fresh interpreter would decide anew, and how each is made
right in the child: the environment (replaced by the stand-in's before the module runs; what a module
read from it at import is the worker's, the same for every rank but the per-rank variables, which
nothing the template imports reads at import; ``store.settings``' cache is cleared), intra-op threads (``torch.set_num_threads`` from
``OMP_NUM_THREADS``, else the affinity's CPUs), cached CUDA device counts (cleared: the rank's
``CUDA_VISIBLE_DEVICES`` differs from the worker's); CUDA itself is never initialised in the template
(``PYTORCH_NVML_BASED_CUDA_CHECK``, checked after the preload, which also checks that the template
started no Python thread: a fork copies only the calling thread). Python's ``random`` reseeds itself in a
forked child; the exit runs non-daemon threads' joins and ``atexit`` as an interpreter's end does.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

#: The template's socket, in a rank's environment.
TEMPLATE_ENV = "ZENFLOW_TEMPLATE_SOCKET"
#: How long a stand-in waits for a template that is still importing (the worker's first job) before it
#: execs instead; it stops waiting at once when the template has gone.
READY_WAIT_SECONDS = 600.0
#: Signals a stand-in passes on to its child (SIGKILL and SIGSTOP cannot be caught: a killed stand-in
#: closes its connection, and the template kills the child).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)
#: Variables that may differ between the template and a rank it runs: set per launch or per rank (the
#: elastic agent's ``env://`` ones, the launcher's), or read at run time only (``ZENFLOW_``: through
#: ``store.settings.get_settings``, whose cache a child clears). Nothing the template preloads reads
#: them at import; any other difference means the rank starts a new interpreter.
PER_RANK_VARS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
PER_RANK_PREFIXES = ("TORCHELASTIC_", "ZENFLOW_")
_HEADER = struct.Struct("!I")
_MAX_REQUEST_BYTES = 64 << 20
_PR_SET_PDEATHSIG = 1


def signal_main_thread(pid: int, signum: int) -> None:
    """``signum`` to process ``pid``'s main thread (Linux ``tgkill``), where its Python handler runs: a
    process-directed signal may be taken by another thread (torch's pool), and then a main thread
    blocked in a system call (a sleep, a wait) is not woken to run the handler until that call ends.
    Elsewhere, or without ``tgkill``, a process-directed ``kill``."""
    tgkill = getattr(_libc(), "tgkill", None) if sys.platform.startswith("linux") else None
    if tgkill is None or tgkill(pid, pid, signum) != 0:
        os.kill(pid, signum)  # ProcessLookupError when it is gone, as tgkill's ESRCH


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (thread) dies; exit at once if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)


def start_bound(cmd: Sequence[str], env: Mapping[str, str], **popen: Any) -> subprocess.Popen[bytes]:
    """``cmd`` in a process group of its own that dies with the calling thread (:func:`die_with_parent`)."""
    parent = os.getpid()
    return subprocess.Popen(
        list(cmd),
        env=dict(env),
        close_fds=True,
        process_group=0,
        preexec_fn=lambda: die_with_parent(parent),
        **popen,
    )


@dataclass
class Request:
    """What a stand-in asks the template to run (sent as JSON, with its fds 0-2 beside it)."""

    executable: str
    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    affinity: list[int] = field(default_factory=list)


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that a template and the ranks it runs must share (see PER_RANK_VARS)."""
    return {k: v for k, v in env.items() if k not in PER_RANK_VARS and not k.startswith(PER_RANK_PREFIXES)}


def env_difference(a: Mapping[str, str], b: Mapping[str, str]) -> str | None:
    """The first variable whose value differs between two :func:`import_env` results, if any."""
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return key
    return None


def module_of(cmd: Sequence[str]) -> tuple[str, list[str]] | None:
    """(module, args) of ``[sys.executable, "-m", MODULE, ARGS...]``, the one shape a template runs."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2]:
        return cmd[2], list(cmd[3:])
    return None


def _send_message(sock: socket.socket, payload: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(payload).encode()
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data))], list(fds))
    else:
        sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


def _recv_message(sock: socket.socket, with_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    if with_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, with_fds)
        head += _recv_exact(sock, _HEADER.size - len(head)) if len(head) < _HEADER.size else b""
    else:
        head = _recv_exact(sock, _HEADER.size)
    (size,) = _HEADER.unpack(head)
    if size > _MAX_REQUEST_BYTES:
        raise ValueError(f"a message of {size} bytes")
    return json.loads(_recv_exact(sock, size)), fds


# --- the stand-in (a rank's process under the agent) ------------------------------------------------


def _connect(path: str, wait: float) -> socket.socket | None:
    """A connection to the template at ``path``; None when it is gone, or not ready within ``wait`` s
    (it binds its socket once its preload is done; its pid file says whether it still runs)."""
    deadline = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
        if time.monotonic() > deadline or not _template_alive(path):
            return None
        time.sleep(0.1)


def _template_alive(path: str) -> bool:
    """Whether the template named by ``path``'s pid file runs (not a zombie its parent has not reaped)."""
    try:
        pid = int(Path(path + ".pid").read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return False
    return state not in ("Z", "X")


def run_forked(cmd: Sequence[str], env: Mapping[str, str], *, pid_file: str | None = None) -> int | None:
    """Run ``cmd`` as a child of the template named in ``env`` and end this process as it ends; None
    (nothing started) where the template cannot run it, for the caller to exec it instead.
    ``pid_file``: where to record the child's pid (its metrics are filed under it)."""
    path = env.get(TEMPLATE_ENV)
    target = module_of(cmd)
    if not path or target is None:
        return None
    sock = _connect(path, READY_WAIT_SECONDS)
    if sock is None:
        return None
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    request = Request(sys.executable, target[0], target[1], dict(env), os.getcwd(), affinity)
    pending: list[int] = []
    child: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if child:
            with contextlib.suppress(ProcessLookupError):
                signal_main_thread(child[0], signum)
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        _send_message(sock, request.__dict__, fds=(0, 1, 2))
        started, _ = _recv_message(sock)
    except (OSError, EOFError, ValueError):
        _restore_signals()
        return None  # the template went away before it forked: nothing runs, exec instead
    if "error" in started:
        _restore_signals()
        print(f"process template: {started['error']}; starting a new interpreter", file=sys.stderr)
        return None
    child.append(int(started["pid"]))
    if pid_file:
        _write_pid(pid_file, child[0])
    for signum in pending:
        with contextlib.suppress(ProcessLookupError):
            signal_main_thread(child[0], signum)
    _end_as(_wait_status(sock))


def _restore_signals() -> None:
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


def _write_pid(path: str, pid: int) -> None:
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    tmp.write_text(str(pid))
    tmp.replace(path)


def _wait_status(sock: socket.socket) -> int:
    """The child's wait status, as the template reports it; a template gone meanwhile took the child
    with it (SIGKILL)."""
    try:
        ended, _ = _recv_message(sock)
        return int(ended["status"])
    except (OSError, EOFError, ValueError, KeyError):
        return int(signal.SIGKILL)  # a raw wait status: killed by SIGKILL


def _end_as(status: int) -> NoReturn:
    """Exit as a process that ended with wait status ``status`` did: its code, or its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process by default
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


# --- the template --------------------------------------------------------------------------------


def preload(modules: Sequence[str]) -> None:
    """Import ``modules`` (dotted names; missing ones skipped) with CUDA untouched. Raises RuntimeError
    where the result cannot be forked safely (CUDA initialised, a Python thread started)."""
    import threading

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"process template: skipping {name}: {e}", file=sys.stderr)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised while preloading: a forked rank could not use it")
    if threading.active_count() != 1:  # native pools (OpenBLAS) handle a fork themselves (pthread_atfork)
        raise RuntimeError(f"{threading.active_count()} Python threads after preloading: a fork copies one")


class _Server:
    """The template's loop: accept a stand-in, fork its child, report the child's end, kill a child
    whose stand-in has gone."""

    def __init__(self, listener: socket.socket, env: Mapping[str, str]) -> None:
        self.listener, self.env = listener, import_env(env)
        self.selector = selectors.PollSelector()  # no descriptor of its own for a child to close
        self.children: dict[int, socket.socket] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")

    def serve(self, parent: int) -> None:
        while os.getppid() == parent:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 512)
                else:
                    self._stand_in_gone(key.data)
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(10.0)
        try:
            payload, fds = _recv_message(conn, with_fds=3)
            request = Request(**payload)
        except (OSError, EOFError, ValueError, TypeError) as e:
            with contextlib.suppress(OSError):
                _send_message(conn, {"error": f"bad request: {e}"})
            conn.close()
            return
        refusal = self._refusal(request, fds)
        if refusal:
            with contextlib.suppress(OSError):
                _send_message(conn, {"error": refusal})
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing of the template's own output is written again by a child
        pid = os.fork()
        if pid == 0:
            _become(request, fds, self._own_fds(conn))
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        with contextlib.suppress(OSError):
            _send_message(conn, {"pid": pid})
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _refusal(self, request: Request, fds: list[int]) -> str | None:
        if request.executable != sys.executable or len(fds) != 3:
            return f"this template runs {sys.executable} with stdin, stdout and stderr"
        differs = env_difference(self.env, import_env(request.env))
        if differs:
            return f"the environment differs from the template's in {differs}"
        return None

    def _own_fds(self, conn: socket.socket) -> list[int]:
        """What a child must close: the template's sockets and pipe (its stand-in's included)."""
        return [self.listener.fileno(), self.wake_r, self.wake_w, conn.fileno()] + [
            s.fileno() for s in self.children.values()
        ]

    def _stand_in_gone(self, pid: int) -> None:
        self.selector.unregister(self.children[pid])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                _send_message(conn, {"status": status})
            conn.close()


def _become(request: Request, fds: list[int], template_fds: list[int]) -> NoReturn:
    """In the forked child: take on the stand-in's process state, run the module, exit as it ends."""
    code = 1
    try:
        _take_on(request, fds, template_fds)
        code = _run_module(request.module, request.args)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _take_on(request: Request, fds: list[int], template_fds: list[int]) -> None:
    signal.set_wakeup_fd(-1)
    for sig in (*FORWARDED, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interpreter's start sets them
    os.setsid()
    die_with_parent(os.getppid())
    for fd in template_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    if request.affinity and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, request.affinity)
    # the threads torch's reset starts (its intra-op pool) inherit this mask: blocked there, the stand-in's
    # signals go to the main thread, which runs the handlers
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        _reset_torch(request)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)


def _reset_torch(request: Request) -> None:
    """What torch (and the settings) decided from the template's environment, decided from the rank's."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    threads = request.env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(
        int(threads) if threads.isdigit() and int(threads) > 0 else len(request.affinity) or 1
    )
    cuda = torch.cuda
    if hasattr(cuda, "_cached_device_count"):
        cuda._cached_device_count = None
    for name in ("device_count", "_device_count_nvml"):
        clear = getattr(getattr(cuda, name, None), "cache_clear", None)
        if clear is not None:
            clear()
    settings = sys.modules.get("store.settings")
    if settings is not None:
        settings.get_settings.cache_clear()
    utils = sys.modules.get("transformers.utils.import_utils")
    for fn in vars(utils).values() if utils is not None else ():
        if callable(fn) and hasattr(fn, "cache_clear") and getattr(fn, "__name__", "").startswith("is_torch"):
            fn.cache_clear()


def _run_module(module: str, args: list[str]) -> int:
    """``python -m module args`` in this process: its exit code (1 and the traceback on an exception)."""
    import runpy
    import threading
    import traceback

    sys.argv = [module, *args]
    if not hasattr(sys.modules.get(module), "__path__"):
        sys.modules.pop(module, None)  # preloaded for its imports: ``python -m`` runs it afresh, as __main__
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # join non-daemon threads, as the interpreter's end does
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def serve(path: str, modules: Sequence[str]) -> int:
    """The template's main: preload, then bind ``path`` (its readiness) and serve until its parent ends."""
    parent, env = os.getppid(), dict(os.environ)
    Path(path + ".pid").write_text(str(os.getpid()))
    try:
        preload(modules)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.{os.getpid()}.tmp"
        listener.bind(tmp)
        listener.listen(64)
        os.replace(tmp, path)
        _Server(listener, env).serve(parent)
    except RuntimeError as e:
        print(f"process template: {e}; ranks start new interpreters", file=sys.stderr)
        return 1
    finally:
        for p in (path, path + ".pid"):
            with contextlib.suppress(OSError):
                os.unlink(p)
    return 0


# --- the worker's side ---------------------------------------------------------------------------


class ProcessTemplate:
    """A template process of this process (dying with the thread that starts it): :meth:`start`, name
    :attr:`path` to ranks as ``ZENFLOW_TEMPLATE_SOCKET``, :meth:`close` at the end."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = list(modules)
        self.dir = tempfile.mkdtemp(prefix="zenflow-template-")
        self.path = os.path.join(self.dir, "socket")
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    def start(self, env: Mapping[str, str]) -> ProcessTemplate:
        """Start it in ``env`` (what its ranks' environments must match but for PER_RANK_VARS)."""
        self.env = import_env(env)
        self.proc = start_bound(
            [sys.executable, "-m", "trainer.run.template", self.path, *self.modules],
            {k: v for k, v in env.items() if k != TEMPLATE_ENV},
            stdin=subprocess.DEVNULL,
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether it still runs and can run ranks started in ``env``."""
        return self.alive() and env_difference(self.env, import_env(env)) is None

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether it serves (waiting up to ``timeout`` s while it still imports)."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m trainer.run.template SOCKET [MODULE...]", file=sys.stderr)
        return 2
    return serve(args[0], args[1:])


if __name__ == "__main__":
    sys.exit(main())
