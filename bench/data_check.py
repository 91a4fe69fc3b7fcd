"""The data check at job create against a running API (issue 25's probes): the create time of a
training file of one line holding N alternating user/assistant messages, and another team's
``GET /v1/fine_tuning/jobs`` latency while K such creates are in flight.

    .venv/bin/python -m bench.data_check                                  # N = 1000 2000 4000, K = 11 x 1000
    .venv/bin/python -m bench.data_check --sizes 1000 2000 --concurrent 4 --concurrent-size 2000
    .venv/bin/python -m bench.data_check --env ZENFLOW_MAX_EXAMPLE_MESSAGES=100000   # past the default bound

It starts uvicorn (bench.api_load.start_server) on a fresh PostgreSQL database (``--admin-url``'s
server; dropped afterwards) or, with ``--database-url sqlite``, on embedded SQLite; no worker runs, so
created jobs stay queued. Each create names the built-in ``tiny-llama`` (the byte tokenizer) with
``max_seq_length`` 1024; what bounds the check is the rendering of the conversation and its masks,
which the model's size does not change. ``ratio`` is each size's create time over the previous size's
(2.0 for a doubling is linear). The reader's latency is from its request to its response, one
request every ``--read-interval`` seconds while any create runs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.api_load import create_key, start_server

MODEL = "tiny-llama"


def line(n: int) -> bytes:
    """One JSONL line: n alternating user/assistant messages (the issue's 148 KB line is n = 4000)."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"hi {i}"} for i in range(n)]
    return (json.dumps({"messages": msgs}) + "\n").encode()


def upload(client: httpx.Client, key: str, body: bytes) -> str:
    """The file's id; raises RuntimeError with the server's message when the upload is refused."""
    r = client.post(
        "/v1/files",
        headers={"Authorization": f"Bearer {key}"},
        data={"purpose": "fine-tune"},
        files={"file": ("train.jsonl", body, "application/jsonl")},
    )
    if r.status_code != 200:
        raise RuntimeError(f"upload refused, HTTP {r.status_code}: {r.json()['error']['message'][:160]}")
    return str(r.json()["id"])


def create(client: httpx.Client, key: str, file_id: str) -> tuple[float, int, str]:
    t = time.perf_counter()
    r = client.post(
        "/v1/fine_tuning/jobs",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "training_file": file_id, "hyperparameters": {"max_seq_length": 1024}},
    )
    detail = "" if r.status_code == 200 else str(r.json().get("error", {}).get("message", ""))[:160]
    return time.perf_counter() - t, r.status_code, detail


def _admin(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(sql.encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1000, 2000, 4000])
    ap.add_argument("--concurrent", type=int, default=11, help="creates in flight together (0: none)")
    ap.add_argument("--concurrent-size", type=int, default=1000)
    ap.add_argument("--read-interval", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    ap.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--database-url", default="", help="'sqlite': embedded; else a new database is made")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server")
    args = ap.parse_args(argv)

    dbname = ""
    if args.database_url == "sqlite":
        database_url = None
    elif args.database_url:
        database_url = args.database_url
    else:
        dbname = f"zf_bench_dc_{secrets.token_hex(4)}"
        _admin(args.admin_url, f"CREATE DATABASE {dbname}")
        database_url = args.admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
        database_url += f"/{dbname}"
    for kv in args.env:
        name, _, value = kv.partition("=")
        os.environ[name] = value
    server = None
    try:
        with tempfile.TemporaryDirectory(prefix="zf-bench-dc-") as tmp:
            server = start_server(Path(tmp), database_url, None, 1)
            writer, reader = create_key(server.env), create_key(server.env)
            with httpx.Client(base_url=server.url, timeout=args.timeout) as client:
                probe_sizes(client, writer, args.sizes)
                if args.concurrent:
                    probe_reads(server.url, writer, reader, args)
    finally:
        if server is not None:
            server.stop()
        if dbname:
            _admin(args.admin_url, f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
    return 0


def probe_sizes(client: httpx.Client, key: str, sizes: list[int]) -> None:
    seconds, status, _ = create(client, key, upload(client, key, line(2)))
    print(
        f"warm-up create (N=2; the first check starts the server's check processes, if any): {seconds:.2f} s"
    )
    previous: float | None = None
    for n in sizes:
        body = line(n)
        try:
            file_id = upload(client, key, body)
        except RuntimeError as exc:
            print(f"create N={n:5d} ({len(body) / 1024:.0f} KiB): {exc}", flush=True)
            continue
        seconds, status, detail = create(client, key, file_id)
        ratio = f"  ratio {seconds / previous:.2f}" if previous else ""
        print(
            f"create N={n:5d} ({len(body) / 1024:.0f} KiB): {seconds:7.2f} s  HTTP {status}{ratio}",
            flush=True,
        )
        if detail:
            print(f"    {detail}", flush=True)
        previous = seconds


def probe_reads(url: str, writer: str, reader: str, args: argparse.Namespace) -> None:
    with httpx.Client(base_url=url, timeout=args.timeout) as client:
        files = [upload(client, writer, line(args.concurrent_size)) for _ in range(args.concurrent)]
    results: list[tuple[float, int, str]] = []

    def one(file_id: str) -> None:
        with httpx.Client(base_url=url, timeout=args.timeout) as c:
            results.append(create(c, writer, file_id))

    threads = [threading.Thread(target=one, args=(f,)) for f in files]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    latencies: list[float] = []
    failures = 0
    with httpx.Client(base_url=url, timeout=30.0) as c:
        while any(t.is_alive() for t in threads):
            sent = time.perf_counter()
            try:
                c.get(
                    "/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {reader}"}
                ).raise_for_status()
                latencies.append(time.perf_counter() - sent)
            except httpx.HTTPError:
                failures += 1
            time.sleep(args.read_interval)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    codes: dict[int, int] = {}
    for _, status, _ in results:
        codes[status] = codes.get(status, 0) + 1
    print(
        f"{args.concurrent} creates of N={args.concurrent_size} in flight: done in {wall:.1f} s "
        f"(HTTP {codes}); another team's GET /v1/fine_tuning/jobs meanwhile: {len(latencies)} answered, "
        f"{failures} failed (30 s timeout)",
        flush=True,
    )
    if latencies:
        p = sorted(latencies)
        print(
            f"    latency median {statistics.median(p) * 1e3:.0f} ms, p90 {p[int(len(p) * 0.9)] * 1e3:.0f} ms, "
            f"max {p[-1] * 1e3:.0f} ms",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
