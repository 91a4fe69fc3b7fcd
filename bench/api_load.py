"""Load benchmark of the API on loopback: requests/s and p50/p99 latency of list, get and create.

    .venv/bin/python -m bench.api_load                       # embedded SQLite, 200 req/s, 10 s a phase
    .venv/bin/python -m bench.api_load --database-url postgresql://postgres@127.0.0.1/zenflow_bench
    .venv/bin/python -m bench.api_load --url http://127.0.0.1:8000 --api-key zf-...   # a running server

It starts a uvicorn server itself (a subprocess, so the load generator does not share its
interpreter) on a free loopback port with a fresh data directory, creates a team, an API key, a
training file and ``--seed-jobs`` jobs, then drives each phase open-loop at ``--rate`` requests per
second (``--create-rate`` for creates), for at most ``--seconds`` and ``--max-requests`` requests
per phase, and stops by itself. Latency is measured from each request's scheduled send time to its
response, so a server that falls behind is charged for the queueing it causes (no coordinated
omission). Only loopback targets are accepted.

The load generator shares the machine with the server, so it must be cheap: the phases use a
minimal HTTP/1.1 keep-alive client on asyncio streams (``--client raw``, ~0.1 ms of CPU per
request; httpx's async client, ``--client httpx``, spends ~1 ms). Each phase reports the CPU the
client and the server used per request and how busy the whole machine was, so a result can be
told apart from a saturated generator or from other work on the machine (``others`` = machine CPU
minus client and server, in cores). ``late`` is how far the generator fell behind its own schedule.

The server's enqueue is the real one (the embedded SQLite broker, or ``--broker-url``); no worker
consumes, so created jobs stay queued. Target: p99 under 50 ms for reads at 200 req/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlparse

import httpx

from api.server import uvicorn_command
from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
_json_dumps = json.dumps
READ_TARGET_P99_MS = 50.0


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _training_jsonl(n: int = 20) -> bytes:
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} + {i}?"},
                    {"role": "assistant", "content": f"{2 * i}"},
                ]
            }
        )
        for i in range(n)
    ]
    return ("\n".join(lines) + "\n").encode()


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    data_dir: Path
    env: dict[str, str]
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(data_dir: Path, database_url: str | None, broker_url: str | None, workers: int) -> Server:
    port = free_port()
    env = {**os.environ, "ZENFLOW_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if database_url:
        env["ZENFLOW_DATABASE_URL"] = database_url
    if broker_url:
        env["ZENFLOW_BROKER_URL"] = broker_url
    log_path = data_dir / "server.log"
    cmd = uvicorn_command(port, workers=workers)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return Server(proc, url, data_dir, env, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start in 120 s")


def _store_call(env: dict[str, str], code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


_PRELUDE = (
    "import secrets, sys\n"
    "from sqlalchemy.orm import sessionmaker\n"
    "from store.db import make_engine\n"
    "from store.settings import get_settings\n"
    "s = sessionmaker(bind=make_engine(get_settings().resolved_database_url))()\n"
)


def create_key(env: dict[str, str]) -> str:
    """A team and an API key in the server's database (through the store, as ``zenflow keys`` does)."""
    return _store_call(
        env,
        _PRELUDE
        + (
            "from api.core.auth import create_key, create_team\n"
            "team = create_team(s, 'bench-' + secrets.token_hex(4))\n"
            "_, key = create_key(s, team, 'bench')\n"
            "s.commit()\n"
            "print(key)\n"
        ),
    )


def seed_jobs(env: dict[str, str], file_id: str, n: int, model: str) -> list[str]:
    """``n`` queued jobs of the file's team written straight to the database (list/get need rows)."""
    out = _store_call(
        env,
        _PRELUDE
        + (
            "from store.orm import File, FineTuningJob\n"
            f"f = s.get(File, {file_id!r})\n"
            f"jobs = [FineTuningJob(team_id=f.team_id, model={model!r}, training_file_id=f.id, status='queued',\n"
            "                      hyperparameters={'n_epochs': 1}) for _ in range(" + str(int(n)) + ")]\n"
            "s.add_all(jobs)\n"
            "s.commit()\n"
            "print(','.join(j.id for j in jobs))\n"
        ),
    )
    return out.split(",")


class RawResponse:
    __slots__ = ("body", "headers", "status_code")

    def __init__(self, status_code: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.body = body


class RawClient:
    """HTTP/1.1 with keep-alive on asyncio streams, just enough for the measured phases (GET, POST
    JSON; Content-Length or chunked bodies): a load generator that costs the machine little.

    Idle connections are reused newest first and dropped after ``IDLE_S`` (below uvicorn's 5 s
    keep-alive timeout), so a request is never sent on a connection the server is closing."""

    IDLE_S = 2.0

    def __init__(self, base_url: str, headers: dict[str, str], max_connections: int, timeout: float) -> None:
        u = urlparse(base_url)
        self.timeout = timeout
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self._head = f"Host: {self.host}:{self.port}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()
        )
        self._idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def get(self, path: str, params: dict[str, Any] | None = None) -> RawResponse:
        return await self.request("GET", path + ("?" + urlencode(params) if params else ""))

    async def post(self, path: str, json: Any = None) -> RawResponse:
        body = _json_dumps(json).encode()
        return await self.request("POST", path, body, "application/json")

    async def request(
        self, method: str, target: str, body: bytes = b"", content_type: str = ""
    ) -> RawResponse:
        """One exchange, bounded by ``timeout`` (waiting for a connection included), like httpx's."""
        async with asyncio.timeout(self.timeout):
            return await self._request(method, target, body, content_type)

    async def _request(self, method: str, target: str, body: bytes, content_type: str) -> RawResponse:
        async with self._slots:
            reader = writer = None
            while self._idle:
                since, r, w = self._idle.pop()
                if time.monotonic() - since < self.IDLE_S and not r.at_eof():
                    reader, writer = r, w
                    break
                w.close()
            if reader is None or writer is None:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                head = f"{method} {target} HTTP/1.1\r\n{self._head}"
                if body or method in ("POST", "PUT", "PATCH"):
                    head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                writer.write(head.encode("latin-1") + b"\r\n" + body)
                raw = await reader.readuntil(b"\r\n\r\n")
                lines = raw.decode("latin-1").split("\r\n")
                status = int(lines[0].split(" ", 2)[1])
                headers = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        chunk = await reader.readexactly(size + 2)
                        if size == 0:
                            break
                        chunks.append(chunk[:-2])
                    data = b"".join(chunks)
                else:
                    data = await reader.readexactly(int(headers.get("content-length", "0")))
            except BaseException:  # a timeout or a broken connection: never reuse it
                writer.close()
                raise
            if headers.get("connection", "").lower() == "close":
                writer.close()
            else:
                self._idle.append((time.monotonic(), reader, writer))
            return RawResponse(status, headers, data)

    async def aclose(self) -> None:
        while self._idle:
            _, _, writer = self._idle.pop()
            writer.close()


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its direct children (uvicorn's workers)."""
    tick = os.sysconf("SC_CLK_TCK")

    def one(p: int | str) -> tuple[int, float]:
        f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[1]), (int(f[11]) + int(f[12])) / tick  # ppid, utime + stime

    total = one(pid)[1]
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != pid:
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid, cpu = one(d)
                if ppid == pid:
                    total += cpu
    return total


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores, /proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


class CpuMeter:
    """CPU used by this process (the client), by the server process and by the whole machine."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.linux = Path("/proc/stat").exists()

    def sample(self) -> tuple[float, float | None, float | None]:
        server = None
        machine = None
        if self.linux:
            with contextlib.suppress(OSError, ValueError):
                machine = _machine_busy_s()
            if self.server_pid is not None:
                with contextlib.suppress(OSError, ValueError):
                    server = _proc_cpu_s(self.server_pid)
        return time.process_time(), server, machine


@dataclass
class Phase:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    wall_s: float = 0.0
    late_ms: float = 0.0  # how far the generator itself fell behind its schedule (client saturation)
    client_cpu_s: float = 0.0
    server_cpu_s: float | None = None
    machine_cpu_s: float | None = None

    def pct(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]  # nearest rank

    def line(self, rate: float) -> str:
        n = len(self.latencies_ms)
        ok = sum(v for k, v in self.statuses.items() if 200 <= k < 300)
        return (
            f"{self.name:<7} target {rate:6.0f} req/s  achieved {n / self.wall_s if self.wall_s else 0:7.1f} req/s  "
            f"n={n:<5} ok={ok:<5} errors={self.errors:<3} p50 {self.pct(50):7.2f} ms  p99 {self.pct(99):7.2f} ms  "
            f"max {max(self.latencies_ms, default=float('nan')):7.2f} ms  mean {statistics.fmean(self.latencies_ms) if n else float('nan'):6.2f} ms"
            f"  statuses {dict(sorted(self.statuses.items()))}\n{'':<9}{self.cpu_line()}"
        )

    def cpu_line(self) -> str:
        n = max(1, len(self.latencies_ms))
        wall = self.wall_s or 1.0
        out = f"cpu: client {self.client_cpu_s / n * 1000:.2f} ms/req ({self.client_cpu_s / wall:.2f} cores)"
        if self.server_cpu_s is not None:
            out += (
                f"  server {self.server_cpu_s / n * 1000:.2f} ms/req ({self.server_cpu_s / wall:.2f} cores)"
            )
        if self.machine_cpu_s is not None:
            others = self.machine_cpu_s - self.client_cpu_s - (self.server_cpu_s or 0.0)
            out += (
                f"  machine {self.machine_cpu_s / wall:.2f} of {os.cpu_count()} cores"
                f" (others {max(0.0, others) / wall:.2f})"
            )
        return out + f"  late {self.late_ms:.1f} ms"


async def run_phase(
    client: Any,
    name: str,
    make_request,
    rate: float,
    seconds: float,
    max_requests: int,
    timeout: float,
    meter: CpuMeter | None = None,
) -> Phase:
    """Open loop: request i is sent at start + i / rate, whatever happened to the earlier ones."""
    ph = Phase(name)
    n = max(1, min(max_requests, int(rate * seconds)))
    before = meter.sample() if meter else None
    start = time.perf_counter() + 0.05
    tasks = []

    async def one(i: int, scheduled: float) -> None:
        try:
            r = await asyncio.wait_for(make_request(client, i), timeout)
            ph.statuses[r.status_code] = ph.statuses.get(r.status_code, 0) + 1
        except Exception:
            ph.errors += 1
        ph.latencies_ms.append((time.perf_counter() - scheduled) * 1000)

    for i in range(n):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            ph.late_ms = max(ph.late_ms, -delay * 1000)
        tasks.append(asyncio.create_task(one(i, scheduled)))
    await asyncio.gather(*tasks)
    ph.wall_s = time.perf_counter() - start
    if meter and before:
        after = meter.sample()
        ph.client_cpu_s = after[0] - before[0]
        if after[1] is not None and before[1] is not None:
            ph.server_cpu_s = after[1] - before[1]
        if after[2] is not None and before[2] is not None:
            ph.machine_cpu_s = after[2] - before[2]
    return ph


def _check(r: httpx.Response) -> httpx.Response:
    if r.is_error:
        raise RuntimeError(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:500]}")
    return r


async def main_async(
    args: argparse.Namespace,
    base_url: str,
    key: str,
    env: dict[str, str] | None,
    server_pid: int | None = None,
) -> list[tuple[Phase, float]]:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=args.timeout
    ) as c:
        r = await c.post(
            "/v1/files",
            files={"file": ("train.jsonl", _training_jsonl(), "application/jsonl")},
            data={"purpose": "fine-tune"},
        )
        file_id = _check(r).json()["id"]
        body = {
            "model": args.model,
            "training_file": file_id,
            "hyperparameters": {"n_epochs": 1, "batch_size": 4},
        }
        if env is not None:
            job_ids = seed_jobs(env, file_id, args.seed_jobs, args.model)
        else:  # a server we did not start: seed through the API
            job_ids = [
                _check(await c.post("/v1/fine_tuning/jobs", json=body)).json()["id"]
                for _ in range(args.seed_jobs)
            ]
        lc: Any = (
            c if args.client == "httpx" else RawClient(base_url, headers, args.connections, args.timeout)
        )
        meter = CpuMeter(server_pid)
        # warm-up: connections, the server's caches
        for i in range(20):
            await lc.get("/v1/fine_tuning/jobs", params={"limit": 20})
            await lc.get(f"/v1/fine_tuning/jobs/{job_ids[i % len(job_ids)]}")

        def do_list(client, i):
            return client.get("/v1/fine_tuning/jobs", params={"limit": 20})

        def do_get(client, i):
            return client.get(f"/v1/fine_tuning/jobs/{job_ids[i % len(job_ids)]}")

        def do_create(client, i):
            return client.post("/v1/fine_tuning/jobs", json=body)

        results = []
        for name, fn, rate in (
            ("list", do_list, args.rate),
            ("get", do_get, args.rate),
            ("create", do_create, args.create_rate),
        ):
            if rate <= 0:
                continue
            # one request at a time first: the service time, i.e. what one server process can sustain
            seq = []
            for i in range(args.probe):
                t0 = time.perf_counter()
                with contextlib.suppress(TimeoutError, httpx.HTTPError, OSError, asyncio.IncompleteReadError):
                    await asyncio.wait_for(fn(lc, i), args.timeout)
                seq.append((time.perf_counter() - t0) * 1000)
            if seq:
                p50 = statistics.median(seq)
                print(
                    f"{name:<7} sequential: p50 {p50:6.2f} ms ({1000 / p50:6.0f} req/s one at a time)",
                    flush=True,
                )
            ph = await run_phase(lc, name, fn, rate, args.seconds, args.max_requests, args.timeout, meter)
            results.append((ph, rate))
            print(ph.line(rate), flush=True)
            await drain(lc, do_get, args.timeout)
        if lc is not c:
            await lc.aclose()
        return results


async def drain(client: Any, probe, timeout: float, limit_s: float = 120.0) -> None:
    """Wait until the server has worked off a backlog (a real request is fast again) before the next phase."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(probe(client, 0), timeout)
            if time.perf_counter() - t0 < 0.05:
                return
        except (TimeoutError, httpx.HTTPError, OSError, asyncio.IncompleteReadError):
            pass
        await asyncio.sleep(0.5)


def _loop_factory() -> Any:
    """uvloop for the generator when it is installed (less CPU per request), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server on loopback (default: start one)")
    p.add_argument("--api-key", help="key for --url (default: create a team and key in its database)")
    p.add_argument("--database-url", help="for the started server (default: embedded SQLite in a temp dir)")
    p.add_argument("--broker-url", help="for the started server (default: embedded SQLite broker)")
    p.add_argument("--server-workers", type=int, default=1)
    p.add_argument("--rate", type=float, default=200.0, help="list and get requests per second")
    p.add_argument("--create-rate", type=float, default=50.0, help="create requests per second (0 skips)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase (at most 120)")
    p.add_argument("--max-requests", type=int, default=5000, help="cap on requests per phase")
    p.add_argument("--seed-jobs", type=int, default=50)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="HTTP client of the measured phases (raw: minimal asyncio HTTP/1.1, cheap on CPU)",
    )
    p.add_argument("--probe", type=int, default=30, help="sequential requests per operation before its phase")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--model", default="tiny-llama")
    args = p.parse_args(argv)
    args.seconds = min(max(args.seconds, 0.5), 120.0)
    args.max_requests = min(max(args.max_requests, 1), 50_000)

    server = None
    tmp = None
    try:
        if args.url:
            if not _is_loopback(args.url):
                print("refusing a non-loopback target", file=sys.stderr)
                return 2
            base_url = args.url.rstrip("/")
            if not args.api_key:
                print("--url needs --api-key", file=sys.stderr)
                return 2
            key = args.api_key
        else:
            tmp = tempfile.TemporaryDirectory(prefix="zf-bench-")
            server = start_server(Path(tmp.name), args.database_url, args.broker_url, args.server_workers)
            base_url = server.url
            key = create_key(server.env)
        print(
            f"api_load: {base_url}  db={'given' if args.database_url or args.url else 'embedded sqlite'}  "
            f"{os.cpu_count()} cpus  phase {args.seconds:g} s, <= {args.max_requests} requests  "
            f"client {args.client}  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
            flush=True,
        )
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            results = runner.run(
                main_async(
                    args, base_url, key, server.env if server else None, server.proc.pid if server else None
                )
            )
        reads = [ph for ph, _ in results if ph.name in ("list", "get")]
        worst = max((ph.pct(99) for ph in reads), default=float("nan"))
        verdict = "met" if worst < READ_TARGET_P99_MS else "NOT met"
        print(
            f"read p99 target (< {READ_TARGET_P99_MS:g} ms at {args.rate:g} req/s): {verdict} (worst {worst:.2f} ms)"
        )
        return 0
    finally:
        if server is not None:
            server.stop()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
