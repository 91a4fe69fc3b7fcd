"""docker-compose.yml and the Dockerfile, checked without a Docker engine: services, healthchecks,
GPU reservation, mounted files that exist, and environment names that the settings really read."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from api.core.config import ApiSettings
from api.storage import FRAMING_SLACK
from store.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {
    "proxy",
    "api",
    "serving",
    "worker",
    "worker-node2",
    "redis",
    "postgres",
    "prometheus",
    "grafana",
    "vllm",
    "mlflow",
}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_healthchecks() -> None:
    c = _compose()
    assert set(c["services"]) == SERVICES
    for name, svc in c["services"].items():
        hc = svc.get("healthcheck")
        assert hc and hc.get("test"), f"{name} has no healthcheck"
        assert svc.get("image") or svc.get("build"), name
    for name in ("api", "worker"):
        assert c["services"][name]["build"]["context"] == "."
    for dep in ("postgres", "redis"):
        assert c["services"]["api"]["depends_on"][dep]["condition"] == "service_healthy"
    assert c["services"]["worker"]["depends_on"]["api"]["condition"] == "service_healthy"


def test_worker_runs_one_celery_worker_per_gpu_with_the_launcher() -> None:
    """The README's way: ``python -m worker --gpus auto`` on every GPU of the host (worker/launcher.py starts
    a Celery worker per GPU, solo pool, one job at a time), not one hand-written worker on GPU 0."""
    c = _compose()["services"]
    w = c["worker"]
    devices = w["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "cu" in w["build"]["args"]["TORCH_INDEX_URL"]
    assert [_interpolate(a) for a in w["command"]] == ["python", "-m", "worker", "--gpus", "auto"]
    assert "celery" not in " ".join(w["command"]) and "NVIDIA_VISIBLE_DEVICES" not in w["environment"]
    # the healthcheck asks each GPU's worker, whatever their number
    assert w["healthcheck"]["test"] == ["CMD", "python", "-m", "worker.targets", "--check"]
    assert "cpu" in c["api"]["build"]["args"]["TORCH_INDEX_URL"]


def test_prometheus_finds_every_gpu_worker_without_a_target_written_by_hand() -> None:
    """Each worker service's launcher writes its /metrics ports to a volume Prometheus mounts at the same
    path and reads through file_sd (worker/targets.py; run for real in tests/worker/test_targets.py)."""
    c = _compose()
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "zenflow-workers")
    assert "static_configs" not in job  # no `worker:9101` copied per GPU or per service
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    mounts = {v.split(":")[1]: v for v in c["services"]["prometheus"]["volumes"]}
    for name in ("worker", "worker-node2"):
        env = c["services"][name]["environment"]
        folder = env["ZENFLOW_WORKER_TARGETS_DIR"]
        assert f"{folder}/workers-*.json" in files, files
        volume = next(v for v in c["services"][name]["volumes"] if v.split(":")[1] == folder)
        assert not volume.endswith(":ro") and volume.split(":")[0] in c["volumes"]
        assert mounts[folder] == f"{volume.split(':')[0]}:{folder}:ro"
        assert env["ZENFLOW_WORKER_METRICS_PORT"] == "9101" and env["ZENFLOW_WORKER_ADDRESS"] == name
    # the image makes the folder the worker's user's, so a fresh named volume is writable by it
    assert re.search(r"mkdir -p [^\n]*/zenflow-targets", (ROOT / "Dockerfile").read_text())


def test_no_default_passwords() -> None:
    """PostgreSQL's and Grafana's passwords, like the serving token, come only from .env: compose refuses to
    start without them (``${VAR:?message}``), never ``zenflow/zenflow`` or ``admin/admin``."""
    c = _compose()
    required = r"\$\{{{}:\?[^}}]+\}}"
    pg = c["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert re.fullmatch(required.format("POSTGRES_PASSWORD"), pg)
    url = c["x-zenflow-env"]["ZENFLOW_DATABASE_URL"]
    assert re.search(":" + required.format("POSTGRES_PASSWORD") + "@postgres:", url), url
    grafana = c["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(required.format("GRAFANA_ADMIN_PASSWORD"), grafana)
    text = (ROOT / "docker-compose.yml").read_text()
    for name in re.findall(r"\$\{(\w*(?:PASSWORD|TOKEN|SECRET)\w*)[:}]", text):
        assert not re.search(r"\$\{" + name + r"(:?-|\})", text), f"{name} has a default or may be empty"


def test_prometheus_is_not_published_nor_controllable() -> None:
    """No lifecycle API (a POST to /-/quit would stop it) and no port open beyond the host's loopback."""
    prom = _compose()["services"]["prometheus"]
    assert not any("lifecycle" in a for a in prom["command"])
    for port in prom.get("ports", []):
        assert str(port).startswith("127.0.0.1:"), port


def test_the_proxy_serves_tls_by_default_with_a_plain_http_choice() -> None:
    """HTTPS on 8443 with a mounted certificate, HTTP on 8080 redirected (deploy/nginx/scheme/https.conf,
    run by real nginx in tests/api/test_proxy.py); PROXY_SCHEME=http mounts the plain one instead."""
    proxy = _compose()["services"]["proxy"]
    assert sorted(p.split(":")[-1] for p in proxy["ports"]) == ["8080", "8443"]
    assert "${ZENFLOW_HTTPS_PORT:-8443}:8443" in proxy["ports"]
    assert _interpolate(proxy["environment"]["PROXY_HTTPS_PORT"]) == "8443"  # the redirect's port
    scheme = next(v for v in proxy["volumes"] if v.endswith(":/etc/nginx/zenflow/scheme.conf:ro"))
    src = scheme.removesuffix(":/etc/nginx/zenflow/scheme.conf:ro")
    assert src == "./deploy/nginx/scheme/${PROXY_SCHEME:-https}.conf"  # TLS unless asked otherwise
    for choice in ("https", "http"):
        assert (ROOT / src.replace("${PROXY_SCHEME:-https}", choice)).is_file()
    https = (ROOT / "deploy/nginx/scheme/https.conf").read_text()
    assert (
        "listen 8443 ssl" in https and "/etc/nginx/certs/tls.crt" in https and "return 308 https://" in https
    )
    certs = _mounts(proxy)["/etc/nginx/certs"]
    assert certs == "./deploy/nginx/certs" and (ROOT / certs / "README.md").is_file()
    assert (
        "include /etc/nginx/zenflow/scheme.conf;"
        in (ROOT / "deploy/nginx/templates/default.conf.template").read_text()
    )


def test_base_models_volume_is_documented_and_the_demo_base_is_served() -> None:
    c = _compose()
    roots = c["x-zenflow-env"]["ZENFLOW_MODEL_ROOTS"].split(":")
    assert roots[0] == "/models"
    # the image's copy of the repository is /app (Dockerfile WORKDIR, COPY . .): the demo base is in it
    assert "WORKDIR /app" in (ROOT / "Dockerfile").read_text()
    demo = [ROOT / r.removeprefix("/app/") / "docs-llama" / "config.json" for r in roots[1:]]
    assert len(demo) == 1 and demo[0].is_file()
    text = (ROOT / "docker-compose.yml").read_text()
    assert "The `zenflow-models` volume starts empty" in text and "zenflow_zenflow-models:/models" in text
    assert "zenflow-models" in (ROOT / "docs/operations.md").read_text()


def test_vllm_is_an_optional_profile_the_api_can_forward_to() -> None:
    c = _compose()
    vllm, api, serving = c["services"]["vllm"], c["services"]["api"], c["services"]["serving"]
    assert vllm["profiles"] == ["vllm"] and "vllm" not in serving.get(
        "depends_on", {}
    )  # the default stack has none
    cmd = " ".join(vllm["command"])
    assert "--enable-lora" in cmd and "--served-model-name" in cmd
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # Adapters are read from the job folders at the path the API knows them by.
    assert "zenflow-data:/data:ro" in vllm["volumes"] and "zenflow-data:/data" in api["volumes"]
    assert "zenflow-data:/data:ro" in serving["volumes"]  # the same paths in the API, serving and vLLM
    # the serving process forwards to vLLM; the API never does
    assert serving["environment"]["ZENFLOW_API_INFERENCE_VLLM_URL"] == "http://vllm:8000"
    assert _default(serving["environment"]["ZENFLOW_API_INFERENCE_BACKEND"]) in ("builtin", "vllm")
    assert "ZENFLOW_API_INFERENCE_VLLM_URL" not in api["environment"]


def test_serving_is_its_own_internal_service_the_api_calls_with_a_shared_token() -> None:
    c = _compose()
    api, serving = c["services"]["api"], c["services"]["serving"]
    assert serving["command"][:3] == ["python", "-m", "serving"] and "8001" in serving["command"]
    assert "ports" not in serving and [str(p) for p in serving["expose"]] == ["8001"]  # internal only
    assert "8001/readyz" in " ".join(serving["healthcheck"]["test"])
    token = "ZENFLOW_API_INFERENCE_SERVER_TOKEN"
    # chat from the API, a reinforcement job's model graders from the workers
    for caller in (api, c["services"]["worker"], c["services"]["worker-node2"]):
        assert caller["environment"]["ZENFLOW_API_INFERENCE_SERVER_URL"] == "http://serving:8001"
        # one variable for all, and no default: compose refuses to start without it
        assert caller["environment"][token] == serving["environment"][token]
    assert re.fullmatch(r"\$\{ZENFLOW_INFERENCE_SERVER_TOKEN:\?.+\}", api["environment"][token])
    assert "serving:8001" in (ROOT / "deploy/prometheus/prometheus.yml").read_text()


def test_mlflow_is_an_optional_profile_the_workers_can_log_to() -> None:
    c = _compose()
    mlflow, worker, api = c["services"]["mlflow"], c["services"]["worker"], c["services"]["api"]
    assert mlflow["profiles"] == ["mlflow"] and "mlflow" not in worker.get("depends_on", {})
    assert "server" in mlflow["command"] and "--port=5000" in mlflow["command"]
    assert any(a.startswith("--allowed-hosts=mlflow,") for a in mlflow["command"])  # its compose name
    assert "mlflow-data:/mlflow" in mlflow["volumes"] and "mlflow-data" in c["volumes"]
    assert _default(worker["environment"]["ZENFLOW_MLFLOW_TRACKING_URI"]) == ""  # off unless set
    assert _default(api["environment"]["ZENFLOW_ALLOWED_INTEGRATIONS"]) == "mlflow,wandb"


def test_bind_mounts_exist_and_named_volumes_are_declared() -> None:
    c = _compose()
    declared = set(c.get("volumes") or {})
    for name, svc in c["services"].items():
        for vol in svc.get("volumes", []):
            src = _interpolate(vol).split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"{name}: {src} missing"
            else:
                assert src in declared, f"{name}: volume {src} not declared"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in c["services"]["prometheus"]["volumes"]}
    assert (ROOT / mounts["/etc/prometheus"] / "prometheus.yml").is_file()
    assert (ROOT / mounts["/etc/prometheus"] / "alerts.yml").is_file()
    g = {v.split(":")[1]: v.split(":")[0] for v in c["services"]["grafana"]["volumes"]}
    assert (ROOT / g["/etc/grafana/provisioning"]).is_dir() and list(
        (ROOT / g["/var/lib/grafana/dashboards"]).glob("*.json")
    )
    # Prometheus scrapes the compose service names and ports.
    prom = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    assert "api:8000" in prom


def test_environment_names_are_settings_fields() -> None:
    c = _compose()
    fields = {f"ZENFLOW_{n.upper()}" for n in Settings.model_fields}
    fields |= {f"ZENFLOW_API_{n.upper()}" for n in ApiSettings.model_fields}
    for name in ("api", "serving", "worker", "worker-node2"):
        env = c["services"][name]["environment"]
        for key in env:
            if key.startswith("ZENFLOW_"):
                assert key in fields, f"{name}: {key} is read by no setting"
        if name == "serving":  # no control plane: no database, no queue
            assert not any(k in env for k in ("ZENFLOW_DATABASE_URL", "ZENFLOW_BROKER_URL"))
            continue
        assert env["ZENFLOW_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["ZENFLOW_BROKER_URL"].startswith("redis://")


def test_dockerfile_defaults() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu", text)
    assert "HEALTHCHECK" in text and "/readyz" in text and "zenflow" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored
    # secrets never enter the image (COPY . .): the .env file and the proxy's key
    assert ".env" in ignored and "deploy/nginx/certs" in ignored


def _interpolate(value: object) -> str:
    """What compose makes of ``value`` with an empty .env: ``${X:-d}`` -> ``d``, ``${X:?m}`` -> ``<X>``."""
    text = re.sub(r"\$\{(\w+):\?[^}]*\}", r"<\1>", str(value))
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def _mounts(service: dict) -> dict[str, str]:
    """A service's volumes, container path -> source (interpolated)."""
    return {_interpolate(v).split(":")[1]: _interpolate(v).split(":")[0] for v in service.get("volumes", [])}


def _default(value: object) -> str:
    """``${X:-default}`` -> ``default``; anything else as it is."""
    m = re.fullmatch(r"\$\{\w+:-(.*)\}", str(value))
    return m.group(1) if m else str(value)


def _nginx_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", text)
    assert m, text
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]


def test_api_is_reached_only_through_the_proxy() -> None:
    c = _compose()
    api, proxy = c["services"]["api"], c["services"]["proxy"]
    assert "ports" not in api and "8000" in [str(p) for p in api["expose"]]
    assert proxy["image"].startswith("nginx:")
    assert [p.split(":")[-1] for p in proxy["ports"]] == ["8080", "8443"]
    assert "${ZENFLOW_API_PORT:-8000}" in proxy["ports"][0]
    assert proxy["depends_on"]["api"]["condition"] == "service_healthy"
    assert proxy["environment"]["PROXY_UPSTREAM"] == "api:8000"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in proxy["volumes"]}
    assert (ROOT / mounts["/etc/nginx/templates"] / "default.conf.template").is_file()
    assert "8080" in " ".join(proxy["healthcheck"]["test"])


def test_proxy_limits_match_the_api() -> None:
    """The proxy refuses before the API would, never something the API takes: its body limits are the
    API's (uploads: max_upload_bytes plus the multipart framing the API allows for), and the API's
    header bound is above the proxy's (16 KiB plus the headers the proxy adds)."""
    c = _compose()
    proxy_env, api_env = c["services"]["proxy"]["environment"], c["services"]["api"]["environment"]
    template = (ROOT / "deploy/nginx/templates/default.conf.template").read_text()
    upload = int(_default(c["x-zenflow-env"]["ZENFLOW_MAX_UPLOAD_BYTES"]))
    assert upload == Settings.model_fields["max_upload_bytes"].default
    assert _nginx_size(_default(proxy_env["PROXY_UPLOAD_BODY_LIMIT"])) >= upload + FRAMING_SLACK
    body = int(_default(proxy_env["ZENFLOW_API_MAX_BODY_BYTES"]))
    assert (
        body
        == int(_default(api_env["ZENFLOW_API_MAX_BODY_BYTES"]))
        == ApiSettings.model_fields["max_body_bytes"].default
    )
    m = re.search(r"large_client_header_buffers (\d+) (\w+);", template)
    assert m, "the proxy bounds request heads"
    proxy_heads = int(m.group(1)) * _nginx_size(m.group(2))
    assert int(api_env["ZENFLOW_API_MAX_HEADER_BYTES"]) >= proxy_heads + 4096
    upstream = re.search(r"^upstream zenflow_api \{\n(.*?)^\}", template, re.S | re.M)
    idle = re.search(r"keepalive_timeout (\d+)s;", upstream.group(1) if upstream else "")
    assert idle, "the upstream keep-alive is bounded"
    assert int(idle.group(1)) < ApiSettings.model_fields["keep_alive_seconds"].default


def test_a_two_node_deployment_shares_the_data_volume_and_has_two_addresses() -> None:
    """``--profile multinode``: a second worker on its own GPU and address, the same queue, and the same
    ``zenflow-data`` volume (checkpoints every node of a job writes), under another Celery node name."""
    c = _compose()["services"]
    one, two = c["worker"], c["worker-node2"]
    assert two["profiles"] == ["multinode"] and "profiles" not in one
    assert "zenflow-data:/data" in one["volumes"] and "zenflow-data:/data" in two["volumes"]
    assert one["environment"]["ZENFLOW_DATA_DIR"] == two["environment"]["ZENFLOW_DATA_DIR"] == "/data"
    assert (one["environment"]["ZENFLOW_WORKER_ADDRESS"], two["environment"]["ZENFLOW_WORKER_ADDRESS"]) == (
        "worker",
        "worker-node2",
    )
    # the same launcher and queues (ZENFLOW_DEFAULT_QUEUE and their GPU kind's), other Celery node names
    assert one["command"][:4] == two["command"][:4] == ["python", "-m", "worker", "--gpus"]
    names = [w["environment"]["ZENFLOW_WORKER_NAME"] for w in (one, two)]
    assert len(set(names)) == 2
    # on one host, each its own GPUs: node2 GPU 1 by default; the comment says how to split them
    assert _interpolate(two["command"][4]) == "1" and "ZENFLOW_WORKER2_GPUS" in two["command"][4]
    assert "ZENFLOW_WORKER_GPUS=0 and ZENFLOW_WORKER2_GPUS=1" in (ROOT / "docker-compose.yml").read_text()


def test_only_the_grader_runners_leave_dockers_seccomp_and_apparmor_profiles() -> None:
    """The API and the workers run Python graders in namespaces of their own (docs/graders.md): seccomp
    and AppArmor unconfined there, no capability added, not privileged; every other service keeps
    Docker's defaults."""
    c = _compose()
    runners = {"api", "worker", "worker-node2"}
    for name, svc in c["services"].items():
        assert not svc.get("privileged") and not svc.get("cap_add"), name
        opts = svc.get("security_opt")
        if name in runners:
            assert opts == ["seccomp=unconfined", "apparmor=unconfined"], name
            assert "user" not in svc, name  # the image's unprivileged user
        else:
            assert opts is None, name
