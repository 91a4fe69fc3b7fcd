"""Start one job's ranks on this node under torch's elastic agent (``torchrun``'s), in a child process.

:func:`start_ranks` runs ``python -m trainer.run.agent`` (:mod:`trainer.run.agent`): that process is the
agent (``torch.distributed.launcher.api.elastic_launch``, c10d rendezvous, no restarts) and starts the
node's ``nproc_per_node`` ranks, each through :mod:`trainer.run.rank_entry`, with the ``env://``
variables the agent sets (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_*). The agent takes the whole group down when one rank fails; the group's code is the
first failing rank's (:class:`RankExit`). A job on ``nnodes`` > 1 runs one such launch per node, every
one with the same ``run_id`` and ``rdzv_endpoint``; none starts its ranks until all have joined.

What is ours, because the agent lacks it: GPU ranks see only their own GPU (the agent's
``virtual_local_rank``), CPU ranks get an even share of the node's cores (:func:`cpu_share`, applied
by the wrapper), every process dies with its parent (``PR_SET_PDEATHSIG``: the agent with the thread
that started it, each rank with the agent), and :meth:`NodeRanks.terminate` forwards a signal to the ranks
themselves (a preemption lets them checkpoint and exit with their own code, which a signal to the
agent would replace by its own teardown).

Used by the worker (:mod:`worker.task`) and by ``zenflow train --nproc N``. Imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from trainer.run.template import TEMPLATE_ENV, start_bound

#: Rank 0's exit when its collective broke because another rank died: never the group's cause while
#: another rank failed on its own (the agent may see both in one round).
EXIT_PEER_LOST = 76
#: How long the other ranks get after SIGTERM (a failing rank's peers) before SIGKILL.
TERM_GRACE_SECONDS = 30
#: How long a node waits for the others to join the rendezvous.
RDZV_TIMEOUT_SECONDS = 900
#: Set for CPU ranks: the wrapper pins each to its share of the cores (no value: GPU ranks).
CPU_SHARE_ENV = "ZENFLOW_RANK_CPU_SHARE"
#: Where the wrapper records each rank's pid (``RANK.pid``), for signals and checks.
RANK_DIR_ENV = "ZENFLOW_RANK_DIR"
#: The agent's pid, for the wrapper to check that it has not died before PR_SET_PDEATHSIG took effect.
AGENT_PID_ENV = "ZENFLOW_AGENT_PID"
#: Signals to the agent process that it forwards to its ranks (its own SIGTERM/SIGINT stop them).
FORWARD_SIGNALS = {signal.SIGTERM: signal.SIGUSR1, signal.SIGINT: signal.SIGUSR2}


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


@dataclass(frozen=True)
class RankExit:
    """How a node's ranks ended: ``code`` 0, the first failing rank's exit code (negative: the signal
    that killed it), or, with ``rank`` None, the agent's own end (negative: its signal)."""

    code: int
    rank: int | None = None


@dataclass(frozen=True)
class AgentConfig:
    """What the agent process is told (as JSON): the node's layout and where to write its result."""

    cmd: list[str]
    nproc_per_node: int
    nnodes: int
    rdzv_endpoint: str
    run_id: str
    gpus: bool
    term_grace: int
    rdzv_timeout: int
    result: str
    log_dir: str
    rdzv_host: bool | None = None
    local_addr: str | None = None
    monitor_interval: float = 0.1


#: The suffix of a rank's second pid file: the process that runs its command, where that is not the
#: rank's own (forked by the process template, :mod:`trainer.run.template`).
RUN_PID_SUFFIX = "run"


def read_pids(rank_dir: str | os.PathLike[str], suffix: str = "pid") -> dict[int, int]:
    """{global rank: pid} of the ranks the wrapper has started in ``rank_dir`` (``suffix`` "run": of
    the processes forked to run their commands)."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for f in Path(rank_dir).glob(f"*.{suffix}"):
            with contextlib.suppress(OSError, ValueError):
                out[int(f.stem)] = int(f.read_text())
    return out


class NodeRanks:
    """One node's part of a job, run by the agent in a child process; see the module docstring.

    Not started until :meth:`start`; :meth:`wait` returns the :class:`RankExit` once the agent has
    exited, :meth:`terminate` forwards SIGTERM or SIGINT to every rank, :meth:`kill` ends everything.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        nproc_per_node: int,
        nnodes: int = 1,
        rdzv_endpoint: str | None = None,
        rdzv_host: bool | None = None,
        local_addr: str | None = None,
        run_id: str,
        devices: Sequence[str] | None,
        env: Mapping[str, str],
        term_grace: int = TERM_GRACE_SECONDS,
        rdzv_timeout: int = RDZV_TIMEOUT_SECONDS,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> None:
        if not cmd:
            raise ValueError("no command to run")
        if nproc_per_node < 1 or nnodes < 1:
            raise ValueError(f"{nnodes} nodes of {nproc_per_node} ranks: both must be at least 1")
        if devices is not None and len(devices) < nproc_per_node:
            raise ValueError(f"{nproc_per_node} ranks need {nproc_per_node} GPUs; {len(devices)} given")
        if rdzv_endpoint is None and nnodes > 1:
            raise ValueError("a job on several nodes needs their common rdzv_endpoint")
        self.dir = tempfile.mkdtemp(prefix="zenflow-ranks-")
        self.config = AgentConfig(
            cmd=list(cmd),
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}",
            rdzv_host=rdzv_host,
            local_addr=local_addr if local_addr is not None or nnodes > 1 else "127.0.0.1",
            run_id=run_id,
            gpus=devices is not None,
            term_grace=term_grace,
            rdzv_timeout=rdzv_timeout,
            result=os.path.join(self.dir, "result.json"),
            log_dir=os.path.join(self.dir, "logs"),
        )
        self.env = dict(env)
        self.env[RANK_DIR_ENV] = os.path.join(self.dir, "pids")
        if devices is not None:
            self.env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices[:nproc_per_node])
            self.env.pop(CPU_SHARE_ENV, None)
        else:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
            self.env[CPU_SHARE_ENV] = "1"
        self.stdout, self.stderr = stdout, stderr
        self.proc: subprocess.Popen[bytes] | None = None
        self._pids: dict[int, int] = {}
        self._run_pids: dict[int, int] = {}
        self._exit: RankExit | None = None

    @property
    def pids(self) -> list[int]:
        """This node's rank pids, by global rank (those started so far; kept after the end)."""
        if self._exit is None:
            self._pids.update(read_pids(self.env[RANK_DIR_ENV]))
        return [self._pids[r] for r in sorted(self._pids)]

    @property
    def run_pids(self) -> list[int]:
        """The pids of the processes that run the ranks' command, by global rank: a rank's own pid, or
        the one the process template forked for it (what its metrics are filed under)."""
        if self._exit is None:
            self._run_pids.update(read_pids(self.env[RANK_DIR_ENV], RUN_PID_SUFFIX))
        pids = self.pids
        return [self._run_pids.get(r, pid) for r, pid in zip(sorted(self._pids), pids, strict=True)]

    def _groups(self) -> set[int]:
        """Every rank's process group: its own and, forked by the template, its command's."""
        return set(self.pids) | set(self.run_pids)

    @property
    def agent_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> NodeRanks:
        """Start the agent (in its own process group, dying with the calling thread; forked from the
        process template where ``env`` names one)."""
        os.makedirs(self.env[RANK_DIR_ENV], exist_ok=True)
        cfg = os.path.join(self.dir, "config.json")
        Path(cfg).write_text(json.dumps(asdict(self.config)))
        agent = [sys.executable, "-m", "trainer.run.agent", cfg]
        if self.env.get(TEMPLATE_ENV):  # forked from the process template, trainer.run.stand_in for it
            agent = [sys.executable, "-m", "trainer.run.stand_in", *agent]
        self.proc = start_bound(agent, self.env, stdout=self.stdout, stderr=self.stderr)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Forward ``sig`` (SIGTERM or SIGINT) to every rank through the agent; the group's code is still
        decided by how the ranks exit."""
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(FORWARD_SIGNALS.get(signal.Signals(sig), signal.SIGUSR1))

    def kill(self) -> None:
        """SIGKILL every rank (and its process group: what it started) and the agent."""
        for pid in self._groups():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def wait(self, timeout: float | None = None) -> RankExit:
        """Wait for the agent to exit; how the ranks ended. Raises subprocess.TimeoutExpired (still
        running) after ``timeout`` seconds."""
        if self._exit is not None:
            return self._exit
        if self.proc is None:
            raise RuntimeError("not started")
        rc = self.proc.wait(timeout)
        groups = self._groups()  # the last look at the pid files
        try:
            result = json.loads(Path(self.config.result).read_text())
            self._exit = RankExit(int(result["code"]), result.get("rank"))
        except (OSError, ValueError, KeyError, TypeError):  # the agent died before it could say
            self._exit = RankExit(rc if rc != 0 else 1)
        for pid in groups:  # anything the ranks left behind in their process groups
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        return self._exit

    def close(self) -> None:
        """Kill whatever still runs, reap it, remove the launch's files."""
        if self.alive():
            self.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> NodeRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
