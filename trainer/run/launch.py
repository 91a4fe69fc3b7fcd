"""Start and supervise the ranks of one multi-rank job (torch.distributed's ``env://`` convention).

:func:`rank_env` is one rank's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
its GPU through ``CUDA_VISIBLE_DEVICES``, so every rank trains on ``cuda:0``; a CPU rank gets an even
share of the allowed cores instead, applied with ``sched_setaffinity`` in the child, and
``OMP_NUM_THREADS`` to match). :class:`RankGroup` starts one child per rank and treats them as one
unit: a rank that dies while the others run (a crash, the OOM killer, an exit code) takes the others
down (SIGTERM, then SIGKILL after a grace period), since the survivors would block in their next
collective; the group's exit code is that failing rank's, or rank 0's when all exit on their own.
Nothing outlives the supervisor: each child dies with the thread that spawned it (PR_SET_PDEATHSIG)
and lives in its own process group, which the teardown signals as a whole.

Used by the worker (:mod:`worker.task`) and by ``zenflow train --nproc N``. Imports no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

log = logging.getLogger("zenflow.launch")

#: A rank's CPU share (kernel cpulist format) for the supervisor to apply in the child; set by
#: :func:`rank_env` for CPU ranks only.
RANK_CPUS_ENV = "ZENFLOW_RANK_CPUS"
#: How long the other ranks get to exit after SIGTERM (a failing rank's peers, or stragglers after
#: rank 0 has exited) before SIGKILL.
TERM_GRACE_SECONDS = 30.0
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the rendezvous port of a group started next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
    return port


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (all online CPUs where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_share(rank: int, world: int, cpus: Sequence[int] | None = None) -> list[int]:
    """Rank ``rank``'s contiguous, disjoint share of ``cpus`` (default: :func:`allowed_cpus`), the
    remainder going to the first ranks; with fewer CPUs than ranks, ranks share a CPU round-robin."""
    pool = sorted(cpus) if cpus is not None else allowed_cpus()
    if not pool:
        return []
    if len(pool) < world:
        return [pool[rank % len(pool)]]
    base, extra = divmod(len(pool), world)
    start = rank * base + min(rank, extra)
    return pool[start : start + base + (1 if rank < extra else 0)]


def _cpulist(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def rank_env(
    rank: int,
    world: int,
    port: int,
    *,
    visible_device: str | None,
    base: Mapping[str, str],
    cpus: Sequence[int] | None = None,
) -> dict[str, str]:
    """``base`` plus rank ``rank``'s torch.distributed variables (one host: LOCAL_RANK = RANK).

    ``visible_device``: the rank's GPU (an index or UUID, as the worker was given it) as its only
    visible device; None makes it a CPU rank: no visible GPU, its :func:`cpu_share` of ``cpus`` in
    :data:`RANK_CPUS_ENV` (applied by :class:`RankGroup`) and ``OMP_NUM_THREADS`` at most that many.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a group of {world}")
    env = dict(base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if visible_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(visible_device)
        env.pop(RANK_CPUS_ENV, None)
        return env
    env["CUDA_VISIBLE_DEVICES"] = ""
    share = cpu_share(rank, world, cpus)
    if share:
        env[RANK_CPUS_ENV] = _cpulist(share)
        threads = len(share)
        with contextlib.suppress(ValueError):
            threads = min(threads, max(1, int(base.get("OMP_NUM_THREADS", threads))))
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def group_envs(
    world: int, *, devices: Sequence[str] | None, base: Mapping[str, str], port: int | None = None
) -> list[dict[str, str]]:
    """Every rank's :func:`rank_env` on one fresh port: rank ``r`` on ``devices[r]``, or CPU ranks when
    ``devices`` is None. Raises ValueError when fewer devices than ranks are given."""
    if devices is not None and len(devices) < world:
        raise ValueError(f"{world} ranks need {world} GPUs; {len(devices)} given")
    port = port or free_port()
    return [
        rank_env(r, world, port, visible_device=None if devices is None else devices[r], base=base)
        for r in range(world)
    ]


def _child_setup(parent_pid: int, cpus: str | None) -> None:
    """In each child before exec: die with the spawning thread (PR_SET_PDEATHSIG), take its CPU share."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except OSError:
            pass
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    if cpus and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


class RankGroup:
    """One job's ranks as one supervised unit; see the module docstring.

    ``argvs[r]`` and ``envs[r]`` start rank ``r`` (``stdout``: one stream for all, or one per rank). :meth:`wait` returns the group's code (negative: the
    signal that killed the failing rank) once no rank is alive; :meth:`terminate` forwards a signal
    to every rank (preemption, cancel escalation).
    """

    def __init__(
        self,
        argvs: Sequence[Sequence[str]],
        envs: Sequence[Mapping[str, str]],
        *,
        term_grace: float = TERM_GRACE_SECONDS,
        cwd: str | os.PathLike[str] | None = None,
        stdout: int | IO[Any] | Sequence[IO[Any]] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> None:
        if not argvs or len(argvs) != len(envs):
            raise ValueError("one argv and one environment per rank")
        self.argvs = [list(a) for a in argvs]
        self.envs = [dict(e) for e in envs]
        self.term_grace = term_grace
        self.cwd, self.stderr = cwd, stderr
        self._outs: list[int | IO[Any] | None] = (
            list(stdout) if isinstance(stdout, list | tuple) else [stdout] * len(self.argvs)  # type: ignore[list-item]
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        #: The first rank that exited non-zero (or by a signal) while others ran: its code is the group's.
        self.failed_rank: int | None = None
        self._exits: dict[int, tuple[int, float]] = {}  # rank -> (code, monotonic time it was reaped)
        self._cond = threading.Condition()
        self._teardown_at: float | None = None
        self._killed = False

    @property
    def world(self) -> int:
        return len(self.argvs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> RankGroup:
        """Start every rank (rank 0 first); a rank that cannot be started stops the ones already up."""
        parent = os.getpid()
        try:
            for rank, (argv, env) in enumerate(zip(self.argvs, self.envs, strict=True)):
                cpus = env.get(RANK_CPUS_ENV)
                p = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self.cwd,
                    stdout=self._outs[rank],
                    stderr=self.stderr,
                    close_fds=True,
                    process_group=0,
                    preexec_fn=lambda c=cpus: _child_setup(parent, c),
                )
                self.procs.append(p)
                threading.Thread(
                    target=self._reap, args=(rank, p), name=f"zenflow-rank-{rank}-wait", daemon=True
                ).start()
        except BaseException:
            self._signal_all(signal.SIGKILL)
            for p in self.procs:
                with contextlib.suppress(Exception):
                    p.wait(10)
            raise
        return self

    def _reap(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """One thread per rank: record when it exited, so the first failure is known even when its
        peers fail a few milliseconds later (on the broken connection)."""
        rc = proc.wait()
        with self._cond:
            self._exits[rank] = (rc, time.monotonic())
            self._cond.notify_all()

    def returncodes(self) -> list[int | None]:
        with self._cond:
            return [self._exits[r][0] if r in self._exits else None for r in range(len(self.procs))]

    def alive(self) -> bool:
        with self._cond:
            return len(self._exits) < len(self.procs)

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to every live rank (a preemption, a cancel's escalation); the group's code is
        still decided by how the ranks exit."""
        self._signal_all(sig)

    def kill(self) -> None:
        """SIGKILL every live rank and its process group."""
        self._signal_all(signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        with self._cond:
            done = set(self._exits)
        for rank, p in enumerate(self.procs):
            if rank in done:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if sig == signal.SIGKILL:  # the rank and whatever it started
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)

    def _first_failure(self, exits: dict[int, tuple[int, float]]) -> int | None:
        """The rank that exited non-zero first before any teardown (what we killed is no failure)."""
        cutoff = self._teardown_at if self._teardown_at is not None else float("inf")
        failures = sorted((t, r) for r, (rc, t) in exits.items() if rc != 0 and t <= cutoff)
        return failures[0][1] if failures else None

    def poll(self) -> int | None:
        """One supervision round: take the group down after a failure (or stragglers after rank 0
        exited), SIGKILL what outlived its grace; the group's code once every rank has exited."""
        now = time.monotonic()
        with self._cond:
            exits = dict(self._exits)
        if self.failed_rank is None:
            self.failed_rank = self._first_failure(exits)
            if self.failed_rank is not None and len(exits) < len(self.procs):
                log.warning(
                    "rank %d of %d exited (%s): stopping the other ranks",
                    self.failed_rank,
                    len(self.procs),
                    _describe(exits[self.failed_rank][0]),
                )
                self._begin_teardown(now)
        if len(exits) == len(self.procs):
            return exits[self.failed_rank if self.failed_rank is not None else 0][0]
        if self._teardown_at is None:
            if 0 in exits and now - exits[0][1] > self.term_grace:
                log.warning("rank 0 exited %.0fs ago: stopping the ranks still running", self.term_grace)
                self._begin_teardown(now)
        elif not self._killed and now - self._teardown_at > self.term_grace:
            log.warning("ranks still running %.0fs after SIGTERM: killing them", self.term_grace)
            self._killed = True
            self._signal_all(signal.SIGKILL)
        return None

    def _begin_teardown(self, now: float) -> None:
        if self._teardown_at is None:
            self._teardown_at = now
            self._signal_all(signal.SIGTERM)

    def wait(self, timeout: float | None = None, *, interval: float = 0.2) -> int:
        """Supervise until every rank has exited; the group's code. Raises subprocess.TimeoutExpired
        (ranks still running, supervision continuing at the next call) after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                self._sweep()
                return code
            left = interval if deadline is None else min(interval, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.argvs[0], timeout or 0.0)
            with self._cond:
                self._cond.wait(left)

    def _sweep(self) -> None:
        """After the last rank: anything left in the ranks' process groups (helpers they started) goes."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.procs and self.alive():
            self.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(30)


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"
