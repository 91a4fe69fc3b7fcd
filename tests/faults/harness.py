"""A real service stack for the fault and observability tests, all on loopback: a private PostgreSQL
database on the local server, a private redis-server on a free port, the API under uvicorn, Celery
workers, a Prometheus server. Every process is started here, owned by the test, and stopped by it.

Timings are shortened through the service settings so a fault plays out in seconds: a heartbeat every
0.5 s, and a worker lost after a timeout derived, per stack, from how slow the machine is at that moment
(:func:`tests.support.heartbeat_timeout`: 4 s on a quiet box, more on a loaded one, where a fixed 4 s
got live jobs re-queued as stale); jobs are tiny (``tiny-llama`` on the CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from api.server import uvicorn_command
from tests import support
from tests.support import drop_database, heartbeat_timeout, unavailable
from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "trainer" / "samples"


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # the thing is not up yet
            last_exc = e
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}"
        + (f" (last error: {last_exc!r})" if last_exc else "")
    )


@dataclass
class Proc:
    """A subprocess in its own process group, with its output in a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(
        cls, name: str, cmd: list[str], *, env: dict[str, str], log_dir: Path, cwd: Path = ROOT
    ) -> Proc:
        log = log_dir / f"{name}.log"
        with open(log, "ab") as f:
            p = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(name, p, log)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal this process only (its children fend for themselves, as after a real crash)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left; reaps the process."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


# --- PostgreSQL ---------------------------------------------------------------------------------


def create_database(prefix: str) -> str:
    """A new PostgreSQL database migrated to head; its URL."""
    from api.migrate import upgrade

    url = support.create_database(prefix)
    upgrade(url)
    return url


# --- Redis ----------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A private redis-server (AOF on, noeviction, as in docker-compose.yml) that can be restarted;
    ``persistent=False``: no AOF and no RDB snapshots (as our CI's Redis), so a restart empties it."""

    dir: Path
    port: int = field(default_factory=free_port)
    proc: Proc | None = None
    persistent: bool = True

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            unavailable("redis-server not installed")
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes" if self.persistent else "no",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--daemonize",
            "no",
        ]
        self.proc = Proc.start(f"redis-{self.port}", cmd, env=dict(os.environ), log_dir=self.dir)
        wait_until(self.ping, 20, "redis-server to answer")
        return self

    def ping(self) -> bool:
        import redis

        return bool(redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5).ping())

    def stop(self) -> None:
        """A clean shutdown (SIGTERM: Redis flushes the AOF and exits)."""
        if self.proc is not None:
            self.proc.popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.popen.wait(20)
            self.proc.stop()
            self.proc = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


# --- the service ----------------------------------------------------------------------------------


@dataclass
class Stack:
    """Settings shared by every process of one test's service, and the processes started for it."""

    tmp: Path
    database_url: str
    broker_url: str
    queue: str = field(default_factory=lambda: f"zf-test-{secrets.token_hex(4)}")
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    api_url: str | None = None
    heartbeat_interval: float = 0.5
    #: Measured when the stack is made (a subprocess start): see tests.support.heartbeat_timeout.
    heartbeat_timeout: float = 0.0

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout:
            self.heartbeat_timeout = heartbeat_timeout(self.heartbeat_interval)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ZENFLOW_", "PROMETHEUS_MULTIPROC"))}
        env.update(
            PYTHONPATH=str(ROOT),
            ZENFLOW_DATA_DIR=str(self.tmp / "data"),
            ZENFLOW_DATABASE_URL=self.database_url,
            ZENFLOW_BROKER_URL=self.broker_url,
            ZENFLOW_DEFAULT_QUEUE=self.queue,
            ZENFLOW_HEARTBEAT_INTERVAL_SECONDS=str(self.heartbeat_interval),
            ZENFLOW_HEARTBEAT_TIMEOUT_SECONDS=f"{self.heartbeat_timeout:.1f}",
            ZENFLOW_API_MIGRATE_ON_START="false",
            CUDA_VISIBLE_DEVICES="",
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
        )
        env.update(self.extra_env)
        env.update(extra)
        return env

    def settings(self) -> Any:
        from store.settings import Settings

        return Settings(
            data_dir=self.tmp / "data",
            database_url=self.database_url,
            broker_url=self.broker_url,
            default_queue=self.queue,
        )

    # processes

    def start_api(self) -> str:
        port = free_port()
        cmd = uvicorn_command(port)
        p = Proc.start(f"api-{port}", cmd, env=self.env(), log_dir=self.tmp)
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if not p.alive():
                raise AssertionError(f"API exited:\n{p.tail()}")
            return httpx.get(url + "/healthz", timeout=1).status_code == 200

        wait_until(up, 90, "the API to start")
        self.api_url = url
        return url

    def start_worker(self, name: str, *, metrics_port: int | None = None, **env: str) -> Proc:
        extra = dict(env)
        if metrics_port:
            extra.update(ZENFLOW_WORKER_METRICS_PORT=str(metrics_port), ZENFLOW_WORKER_NAME=name)
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "--app=worker:celery_app",
            "worker",
            "--pool=solo",
            "--concurrency=1",
            f"--queues={self.queue}",
            f"--hostname={name}@%h",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        p = Proc.start(f"worker-{name}-{len(self.procs)}", cmd, env=self.env(**extra), log_dir=self.tmp)
        self.procs.append(p)
        wait_until(lambda: "ready" in p.tail(20000) or not p.alive(), 90, f"worker {name} to be ready")
        assert p.alive(), p.tail()
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.tail(6000)}" for p in self.procs)

    # the database, directly (the source of truth)

    def session(self) -> Any:
        from store.db import session_scope

        return session_scope(self.database_url)

    def job(self, job_id: str) -> Any:
        from store.orm import FineTuningJob

        with self.session() as s:
            return s.get(FineTuningJob, job_id)

    def events(self, job_id: str) -> list[Any]:
        from sqlalchemy import select

        from store.orm import JobEvent

        with self.session() as s:
            return list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))

    def step_metrics(self, job_id: str) -> list[Any]:
        from sqlalchemy import select

        from store.orm import JobStepMetric

        with self.session() as s:
            return list(
                s.scalars(
                    select(JobStepMetric).where(JobStepMetric.job_id == job_id).order_by(JobStepMetric.step)
                )
            )

    def wait_status(self, job_id: str, statuses: set[str], timeout: float) -> Any:
        def done() -> Any:
            j = self.job(job_id)
            return j if j is not None and j.status in statuses else None

        try:
            return wait_until(done, timeout, f"job {job_id} to reach {sorted(statuses)}", interval=0.2)
        except AssertionError as e:
            j = self.job(job_id)
            evs = "\n".join(f"  {ev.created_at} {ev.level} {ev.message}" for ev in self.events(job_id)[-30:])
            raise AssertionError(
                f"{e}; status {j.status if j else None}\nevents:\n{evs}\n{self.logs()}"
            ) from None

    def create_team_key(self, name: str | None = None) -> tuple[str, str]:
        """(team id, clear API key)."""
        from api.core.auth import create_key, create_team

        with self.session() as s:
            team = create_team(s, name or f"team-{secrets.token_hex(4)}")
            _, key = create_key(s, team, "tests")
            return team.id, key


def training_jsonl(n: int = 64) -> bytes:
    """Chat examples from the shipped sample file (repeated to ``n`` lines)."""
    lines = [ln for ln in (SAMPLES / "capitals_train.jsonl").read_text().splitlines() if ln.strip()]
    out = [lines[i % len(lines)] for i in range(n)]
    return ("\n".join(out) + "\n").encode()


class Client:
    """The public API, as a user calls it."""

    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def upload(self, data: bytes | None = None) -> str:
        r = self.http.post(
            "/v1/files",
            files={"file": ("train.jsonl", data or training_jsonl(), "application/jsonl")},
            data={"purpose": "fine-tune"},
        )
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def create_job(
        self,
        file_id: str,
        *,
        hyperparameters: dict[str, Any],
        engine: dict[str, Any] | None = None,
        model: str = "tiny-llama",
    ) -> str:
        body: dict[str, Any] = {"model": model, "training_file": file_id, "hyperparameters": hyperparameters}
        if engine:
            body["engine"] = engine
        r = self.http.post("/v1/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def close(self) -> None:
        self.http.close()


@contextlib.contextmanager
def stack(tmp: Path, *, prefix: str, redis: RedisServer | None = None, **extra_env: str) -> Iterator[Stack]:
    """A Stack on a new PostgreSQL database and (unless given) a new private Redis; torn down after."""
    db = create_database(prefix)
    own_redis = redis is None
    redis = redis or RedisServer(tmp / "redis").start()
    st = Stack(tmp=tmp, database_url=db, broker_url=redis.url, extra_env=dict(extra_env))
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    try:
        yield st
    except BaseException:
        print(st.logs())  # shown by pytest for the failing test
        raise
    finally:
        st.stop_all()
        if own_redis:
            redis.stop()
        drop_database(db)


def job_params(
    steps: int, *, checkpoint_every: int, batch_size: int = 4, mode: str = "zenflow"
) -> dict[str, Any]:
    """A tiny CPU job's hyperparameters and engine settings."""
    hp = {
        "max_steps": steps,
        "n_epochs": 100,
        "batch_size": batch_size,
        "checkpoint_every": checkpoint_every,
        "eval_every": None,
        "max_seq_length": 128,
        "warmup": 0,
    }
    engine = {"mode": mode}
    if mode == "zenflow":
        engine.update(update_interval=2, select_interval=4)
    return {"hyperparameters": hp, "engine": engine}


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
