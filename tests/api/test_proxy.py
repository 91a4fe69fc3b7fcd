"""The compose deployment's reverse proxy (deploy/nginx/templates/default.conf.template) with the real
nginx binary: the template rendered as the official image renders it (envsubst of the variables the
compose file gives the proxy), checked by ``nginx -t``, then run in front of the API (uvicorn with the
production options): requests pass, uploads stream, events stream unbuffered, and over-long heads,
over-large bodies and /metrics are refused in the API's error envelope."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.server import uvicorn_options
from tests.api.conftest import TEST_API_SETTINGS, TeamKey, chat_jsonl, make_team
from tests.support import unavailable
from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "nginx" / "templates" / "default.conf.template"
_VAR = re.compile(r"\$\{(\w+)\}")
_DEFAULT = re.compile(r"^\$\{\w+:-(.*)\}$")


def proxy_environment() -> dict[str, str]:
    """The proxy service's environment in docker-compose.yml, with each ``${X:-default}`` at its default."""
    env = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["proxy"]["environment"]
    out = {}
    for k, v in env.items():
        m = _DEFAULT.match(str(v))
        out[k] = m.group(1) if m else str(v)
    return out


def render(env: dict[str, str]) -> str:
    """What the image's envsubst step makes of the template: the named variables replaced, nothing else."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), TEMPLATE.read_text())


def test_template_uses_only_variables_the_compose_file_sets() -> None:
    env = proxy_environment()
    used = set(_VAR.findall(TEMPLATE.read_text()))
    assert used and used <= set(env), used - set(env)
    assert "${" not in render(env)


def _nginx() -> str:
    exe = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).is_file()), None)
    if exe is None:
        unavailable("nginx not installed (scripts/bootstrap.sh installs Debian's nginx-light as root)")
    return exe


#: The proxy under test allows 3 inference requests per key at once, then one every 2 s.
RATE_LIMIT = {
    "PROXY_INFERENCE_RATE": "30r/m",
    "PROXY_INFERENCE_BURST": "2",
    "PROXY_INFERENCE_RETRY_AFTER": "2",
}


SCHEMES = ROOT / "deploy" / "nginx" / "scheme"
SCHEME_INCLUDE = "include /etc/nginx/zenflow/scheme.conf;"


def _write_config(
    tmp: Path, upstream: str, port: int, env: dict[str, str] | None = None, scheme: Path | None = None
) -> Path:
    """nginx.conf around the rendered template on loopback ``port``, with the plain-HTTP scheme
    (``PROXY_SCHEME=http``) unless ``scheme`` names another scheme file."""
    rendered = render({**proxy_environment(), **(env or {}), "PROXY_UPSTREAM": upstream})
    assert rendered.count("listen 8080 default_server;") == 1 and rendered.count(SCHEME_INCLUDE) == 1
    rendered = rendered.replace(SCHEME_INCLUDE, f"include {scheme or SCHEMES / 'http.conf'};")
    (tmp / "default.conf").write_text(
        rendered.replace("listen 8080 default_server;", f"listen 127.0.0.1:{port};")
    )
    temps = "\n".join(
        f"    {k}_temp_path {tmp / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = tmp / "nginx.conf"
    conf.write_text(f"""user root;
worker_processes 1;
daemon off;
pid {tmp / "nginx.pid"};
error_log {tmp / "error.log"} warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
{temps}
    include {tmp / "default.conf"};
}}
""")
    return conf


def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    conf = _write_config(tmp_path, "127.0.0.1:9", free_port())
    r = subprocess.run([_nginx(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "syntax is ok" in r.stderr


def _tls_scheme(tmp: Path, tls_port: int) -> Path:
    """deploy/nginx/scheme/https.conf on loopback ``tls_port`` with a self-signed certificate in ``tmp``,
    made as deploy/nginx/certs/README.md says."""
    openssl = shutil.which("openssl") or unavailable("openssl not installed")
    certs = tmp / "certs"
    certs.mkdir()
    subprocess.run(
        [
            *(
                openssl,
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
            ),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
            *("-keyout", str(certs / "tls.key"), "-out", str(certs / "tls.crt")),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    text = (SCHEMES / "https.conf").read_text()
    assert text.count("listen 8443 ssl default_server;") == 1 and "/etc/nginx/certs/tls.key" in text
    text = text.replace("listen 8443 ssl default_server;", f"listen 127.0.0.1:{tls_port} ssl;")
    scheme = tmp / "https.conf"
    scheme.write_text(text.replace("/etc/nginx/certs/", f"{certs}/"))
    return certs / "tls.crt"


def test_tls_at_the_proxy_and_plain_http_redirected(tmp_path: Path) -> None:
    """PROXY_SCHEME=https (compose's default): the API's routes over TLS with the mounted certificate; a
    plain-HTTP request answered 308 to the same URL at the public HTTPS port, method and body kept, but
    /healthz (the container's healthcheck), which reaches the API (here none: the envelope's
    service_unavailable)."""
    port, tls_port = free_port(), free_port()
    cert = _tls_scheme(tmp_path, tls_port)
    conf = _write_config(
        tmp_path, "127.0.0.1:9", port, {"PROXY_HTTPS_PORT": str(tls_port)}, scheme=tmp_path / "https.conf"
    )
    check = subprocess.run([_nginx(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen([_nginx(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            assert time.monotonic() < deadline, "nginx did not come up"
            time.sleep(0.1)
        r = httpx.post(f"http://localhost:{port}/v1/fine_tuning/jobs?limit=1", json={}, timeout=10)
        assert r.status_code == 308
        assert r.headers["location"] == f"https://localhost:{tls_port}/v1/fine_tuning/jobs?limit=1"
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert _error(r)["code"] == "service_unavailable"  # passed on to the API (down), no redirect
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=10) as tls:
            r = tls.get(f"https://localhost:{tls_port}/v1/models")
            assert _error(r)["code"] == "service_unavailable"  # passed on to the API
            assert r.http_version == "HTTP/1.1" and r.url.scheme == "https"
        r = httpx.get(f"http://127.0.0.1:{tls_port}/v1/models", timeout=10)  # plain HTTP to the TLS port
        assert r.status_code == 308 and r.headers["location"].startswith(f"https://127.0.0.1:{tls_port}/")
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def proxied(app: FastAPI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """nginx on a loopback port in front of the app under uvicorn (h11, the production options)."""
    tmp = tmp_path_factory.mktemp("nginx")
    api_port, proxy_port = free_port(), free_port()
    api_settings = TEST_API_SETTINGS.model_copy(update={"max_header_bytes": 24 * 1024})
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=api_port,
            log_level="error",
            lifespan="off",
            **uvicorn_options(api_settings),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    conf = _write_config(tmp, f"127.0.0.1:{api_port}", proxy_port, RATE_LIMIT)
    proc = subprocess.Popen([_nginx(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{proxy_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with contextlib.suppress(httpx.HTTPError):
                if server.started and httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "nginx or uvicorn did not come up"
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        server.should_exit = True
        thread.join(timeout=15)


def _error(r: httpx.Response) -> dict[str, object]:
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    body = json.loads(r.text)
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return dict(body["error"])


def test_requests_pass_and_limits_hold_at_the_proxy(proxied: str, app: FastAPI, client: TestClient) -> None:
    team: TeamKey = make_team(app)
    with httpx.Client(base_url=proxied, headers={"Authorization": f"Bearer {team.key}"}, timeout=30) as c:
        up = c.post(
            "/v1/files",
            data={"purpose": "fine-tune"},
            files={"file": ("t.jsonl", chat_jsonl(4), "application/jsonl")},
        )
        assert up.status_code == 200, up.text
        fid = up.json()["id"]
        assert c.get(f"/v1/files/{fid}").json()["id"] == fid

        r = c.get("/v1/files", headers={"X-Big": "a" * 9000})  # one field over 8 KiB
        assert r.status_code == 431 and _error(r)["code"] == "request_header_too_large"
        r = c.get("/v1/files", headers={f"X-H{i}": "a" * 6000 for i in range(4)})  # 24 KiB in all
        assert r.status_code == 431
        r = c.get("/v1/files?after=" + "a" * 9000)
        assert r.status_code == 414 and _error(r)["code"] == "uri_too_long"

        r = c.post(
            "/v1/fine_tuning/jobs",
            content=b"{" + b" " * (1024 * 1024 + 10) + b"}",
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
        r = c.get("/metrics")
        assert r.status_code == 404 and _error(r)["code"] == "not_found"

        job = c.post("/v1/fine_tuning/jobs", json={"model": "tiny-llama", "training_file": fid})
        assert job.status_code == 200, job.text
        # The event stream is passed on as it comes: the job's first events arrive while the stream stays open.
        t0 = time.monotonic()
        with c.stream(
            "GET",
            f"/v1/fine_tuning/jobs/{job.json()['id']}/events",
            params={"stream": "true"},
            timeout=httpx.Timeout(10, read=5),
        ) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
        assert "Created fine-tuning job" in first and time.monotonic() - t0 < 5


def test_model_downloads_resume_through_the_proxy(proxied: str, app: FastAPI, client: TestClient) -> None:
    """A model's tar through nginx: HEAD gives its length, Range GETs come back 206 from the API and
    join into the whole body; the training state of a 2-rank checkpoint is not in it."""
    import io
    import os
    import tarfile

    from store.model_ids import register_final
    from store.orm import FineTuningJob

    team: TeamKey = make_team(app)
    with httpx.Client(base_url=proxied, headers={"Authorization": f"Bearer {team.key}"}, timeout=30) as c:
        up = c.post(
            "/v1/files",
            data={"purpose": "fine-tune"},
            files={"file": ("t.jsonl", chat_jsonl(4), "application/jsonl")},
        )
        job = c.post("/v1/fine_tuning/jobs", json={"model": "tiny-llama", "training_file": up.json()["id"]})
        assert job.status_code == 200, job.text
        folder = app.state.settings.resolved_jobs_dir / job.json()["id"] / "final"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(os.urandom(300_000))
        for rank in range(2):
            (folder / f"engine-rank{rank:05d}-of-00002.pt").write_bytes(os.urandom(100_000))
        with app.state.sessionmaker() as s:
            model = register_final(s, s.get(FineTuningJob, job.json()["id"]), str(folder)).id
            s.commit()
        url = f"/v1/models/{model}/content"

        full = c.get(url)
        assert full.status_code == 200 and full.headers["accept-ranges"] == "bytes"
        length = len(full.content)
        head = c.head(url)
        assert head.status_code == 200 and int(head.headers["content-length"]) == length
        parts = []
        for start, end in ((0, 1000), (1000, 200_000), (200_000, length)):
            r = c.get(url, headers={"Range": f"bytes={start}-{end - 1}", "If-Range": full.headers["etag"]})
            assert r.status_code == 206 and r.headers["content-range"] == f"bytes {start}-{end - 1}/{length}"
            parts.append(r.content)
        assert b"".join(parts) == full.content
        with tarfile.open(fileobj=io.BytesIO(full.content)) as tar:
            assert tar.getnames() == ["config.json", "model.safetensors"]
        assert c.get(url, headers={"Range": f"bytes={length}-"}).status_code == 416


def test_inference_is_rate_limited_per_key_at_the_proxy(proxied: str, app: FastAPI) -> None:
    """One key's inference requests past the rate and burst are refused by nginx with 429, Retry-After
    and the API's envelope; another key has its own allowance, and other endpoints are not limited."""
    first, second = make_team(app), make_team(app)

    def chat(team: TeamKey) -> httpx.Response:
        return httpx.post(
            f"{proxied}/v1/chat/completions",
            headers={"Authorization": f"Bearer {team.key}"},
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )

    codes = [chat(first).status_code for _ in range(8)]
    assert codes[:3] == [404] * 3, codes  # 1 + the burst of 2 reach the API (an unknown model: 404)
    assert codes.count(429) >= 3, codes  # the rest within seconds: one more every 2 s at most
    refused = chat(first)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
    assert _error(refused)["code"] == "rate_limit_exceeded"
    assert chat(second).status_code == 404  # another key: its own allowance
    with httpx.Client(base_url=proxied, headers={"Authorization": f"Bearer {first.key}"}, timeout=30) as c:
        assert all(c.get("/v1/models").status_code == 200 for _ in range(5))
