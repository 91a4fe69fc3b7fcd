"""deploy/kubernetes, checked without a cluster: the base and each overlay render with ``kubectl
kustomize`` (where kubectl is installed) and every object validates against the Kubernetes schemas of
the oldest and newest versions we support (``kubernetes-validate``, strict: no unknown field); the API,
the serving process, one worker per GPU and the migration Job are there, secrets come only from the
operator's Secret, every ZENFLOW_ variable is a setting, and the Prometheus config is valid."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.core.config import ApiSettings
from store.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes we support and the newest the schemas know.
VERSIONS = ("1.33.0", "1.37.0")
SECRET_KEYS = {"database-url", "broker-url", "inference-server-token", "postgres-password"}
KUSTOMIZATIONS = [K8S / "base", K8S / "overlays" / "in-cluster-services"]


def _files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            yield path


def rendered(folder: Path) -> list[dict[str, Any]]:
    """The kustomization's objects: rendered by kubectl where it is installed, else its files and its
    bases' with the two transformations ours use applied here (namespace, images)."""
    if shutil.which("kubectl"):
        out = subprocess.run(
            ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for item in kustomization["resources"]:
        target = (folder / item).resolve()
        docs += (
            rendered(target) if target.is_dir() else [d for d in yaml.safe_load_all(target.read_text()) if d]
        )
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization.get("images", [])}
    for doc in docs:
        if "namespace" in kustomization and doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = kustomization["namespace"]
        for _, c in _containers([doc]):
            c["image"] = images.get(c["image"], c["image"])
    return docs


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: p.name)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return rendered(request.param)


def _by(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objects:
        spec = o.get("spec", {})
        pod = spec.get("jobTemplate", {}).get("spec", spec).get("template", {}).get("spec")
        for c in (pod or {}).get("containers", []):
            yield o["metadata"]["name"], c


def test_every_object_is_valid_for_the_kubernetes_versions_we_support(objects: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    for obj in objects:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(
                    f"{obj['kind']}/{obj['metadata']['name']} on {version}: {e.message} at {list(e.path)}"
                )


def test_the_components_and_how_they_connect(objects: list[dict[str, Any]]) -> None:
    api = _by(objects, "Deployment", "zenflow-api")["spec"]["template"]["spec"]["containers"][0]
    serving = _by(objects, "Deployment", "zenflow-serving")["spec"]["template"]["spec"]["containers"][0]
    worker_pod = _by(objects, "Deployment", "zenflow-worker")["spec"]["template"]["spec"]
    worker = worker_pod["containers"][0]
    migrate = _by(objects, "Job", "zenflow-migrate")["spec"]["template"]["spec"]["containers"][0]
    assert api["command"][:2] == ["zenflow", "serve"] and "--no-worker" in api["command"]
    assert serving["command"] == ["python", "-m", "serving", "--host", "0.0.0.0", "--port", "8001"]
    assert _by(objects, "Service", "zenflow-serving")["spec"]["ports"][0]["port"] == 8001
    for caller in (api, worker):  # chat; a reinforcement job's model graders
        env = {e["name"]: e for e in caller["env"]}
        assert env["ZENFLOW_API_INFERENCE_SERVER_URL"]["value"] == "http://zenflow-serving:8001"
        token = env["ZENFLOW_API_INFERENCE_SERVER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": "zenflow-secrets", "key": "inference-server-token"}
    # one worker per GPU: a GPU each, the launcher that starts a Celery worker per GPU it sees
    assert worker["command"] == ["python", "-m", "worker", "--gpus", "auto"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1 and worker["image"].endswith(":cuda")
    assert worker_pod["terminationGracePeriodSeconds"] >= 120  # a job checkpoints on SIGTERM
    assert migrate["command"] == ["zenflow", "db", "upgrade"]
    config = _by(objects, "ConfigMap", "zenflow-config")["data"]
    assert config["ZENFLOW_API_MIGRATE_ON_START"] == "false"  # the Job migrates, not each API replica
    policy = _by(objects, "NetworkPolicy", "zenflow-serving-callers")["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "zenflow-serving"}
    callers = [f.get("podSelector", {}).get("matchLabels") for f in policy["ingress"][0]["from"]]
    for caller in ("zenflow-api", "zenflow-worker"):
        assert {"app.kubernetes.io/name": caller} in callers


def test_secrets_come_from_the_operators_secret_and_settings_are_read(objects: list[dict[str, Any]]) -> None:
    assert not [o for o in objects if o["kind"] == "Secret"], "no secret values in the tree"
    fields = {f"ZENFLOW_{n.upper()}" for n in Settings.model_fields}
    fields |= {f"ZENFLOW_API_{n.upper()}" for n in ApiSettings.model_fields}
    config = _by(objects, "ConfigMap", "zenflow-config")["data"]
    assert set(config) <= fields, set(config) - fields
    for owner, c in _containers(objects):
        for e in c.get("env", []):
            assert not e["name"].startswith("ZENFLOW_") or e["name"] in fields, (owner, e["name"])
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "zenflow-secrets" and ref["key"] in SECRET_KEYS, (owner, ref)
            assert not ("PASSWORD" in e["name"] or "TOKEN" in e["name"]) or ref, (owner, e["name"])


def test_the_service_pods_run_as_non_root_with_their_probes(objects: list[dict[str, Any]]) -> None:
    for name in ("zenflow-api", "zenflow-serving", "zenflow-worker"):
        pod = _by(objects, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        c = pod["containers"][0]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert "livenessProbe" in c and "memory" in c["resources"]["limits"], name
    for name in ("zenflow-api", "zenflow-serving"):
        c = _by(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name


def test_only_the_grader_runners_leave_the_default_seccomp_and_apparmor_profiles(
    objects: list[dict[str, Any]],
) -> None:
    """The API and the workers run Python graders in namespaces of their own (docs/graders.md): their
    containers are Unconfined for seccomp and AppArmor, and nothing more (not privileged, every capability
    dropped, none added, non-root); no other container leaves the runtime's defaults."""
    runners = {"zenflow-api", "zenflow-worker"}
    for owner, c in _containers(objects):
        sc = c.get("securityContext", {})
        if owner in runners:
            assert sc["seccompProfile"] == {"type": "Unconfined"}, owner
            assert sc["appArmorProfile"] == {"type": "Unconfined"}, owner
            assert sc.get("privileged") is False and sc["allowPrivilegeEscalation"] is False, owner
            assert sc["capabilities"] == {"drop": ["ALL"]}, owner
        else:
            assert "seccompProfile" not in sc and "appArmorProfile" not in sc, owner
            assert not sc.get("privileged"), owner
    for o in objects:
        pod = o.get("spec", {}).get("template", {}).get("spec", {})
        assert "seccompProfile" not in pod.get("securityContext", {}), o["metadata"]["name"]


def test_prometheus_scrapes_every_component_pod_by_pod(tmp_path: Path) -> None:
    """deploy/kubernetes/prometheus.yml: a valid config (promtool, with the alert rules beside it) whose
    jobs find each component's pods through its headless Service, at the port its containers serve."""
    config = yaml.safe_load((K8S / "prometheus.yml").read_text())
    objects = rendered(K8S / "base")
    ports = {"zenflow-api": 8000, "zenflow-serving": 8001, "zenflow-workers": 9101}
    for job in config["scrape_configs"]:
        (sd,) = job["dns_sd_configs"]
        service = sd["names"][0].split(".")[0]
        svc = _by(objects, "Service", service)["spec"]
        assert svc["clusterIP"] == "None" and sd["port"] == ports[job["job_name"]] == svc["ports"][0]["port"]
    assert set(ports) == {j["job_name"] for j in config["scrape_configs"]}
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    shutil.copy(K8S / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    out = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
