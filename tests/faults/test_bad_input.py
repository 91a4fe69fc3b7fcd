"""Bad input: schemathesis against the service's own OpenAPI schema finds no 5xx and no schema
violation; auth: no key, a wrong key and another team's key are all refused, on every operation.

Schemathesis (4.x, the Python API) generates valid (positive) and invalid (negative) requests for every
operation of ``/openapi.json`` and sends them with a valid key to the app (ASGI, in process) on a
private PostgreSQL database, which is stricter than SQLite about what it stores (NUL bytes, lengths),
so a validation gap shows up as a 5xx. The checks: ``not_a_server_error``, ``status_code_conformance``
(every status answered is documented for its operation: 400/401/404/409/413/415/503 with the error
envelope, no 422), ``response_schema_conformance`` (bodies of documented responses, errors included,
match their schema), ``content_type_conformance`` and ``negative_data_rejection`` (invalid data gets
a 4xx). The schema declares the ``bearerAuth`` (HTTP bearer) scheme on every operation that needs a key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.core.config import ApiSettings
from store.settings import Settings
from tests.faults.harness import create_database, training_jsonl
from tests.support import drop_database

pytestmark = [pytest.mark.services, pytest.mark.timeout(600)]

#: Cases per operation and generation mode; a run at scale sets ZENFLOW_SCHEMATHESIS_EXAMPLES (e.g. 1000,
#: with ``--timeout 0``), the suite keeps the default.
MAX_EXAMPLES = int(os.environ.get("ZENFLOW_SCHEMATHESIS_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    """The app on a private PostgreSQL database, two teams with a key each, team A's file and job."""
    from api.app import create_app
    from api.core.auth import create_key, create_team
    from store.db import session_scope

    url = create_database("zf_badinput")
    tmp = tmp_path_factory.mktemp("badinput")
    enqueued: list[str] = []
    app = create_app(
        Settings(data_dir=tmp, database_url=url, broker_url="memory://"),
        ApiSettings(migrate_on_start=False),
        enqueue=lambda job_id, _q: enqueued.append(job_id),
    )
    with session_scope(url) as s:
        _, key_a = create_key(s, create_team(s, "team-a"))
        _, key_b = create_key(s, create_team(s, "team-b"))
    with TestClient(app) as c:
        h = {"Authorization": f"Bearer {key_a}"}
        r = c.post(
            "/v1/files",
            headers=h,
            files={"file": ("t.jsonl", training_jsonl(16), "application/jsonl")},
            data={"purpose": "fine-tune"},
        )
        assert r.status_code == 200, r.text
        file_id = r.json()["id"]
        r = c.post("/v1/fine_tuning/jobs", headers=h, json={"model": "tiny-llama", "training_file": file_id})
        assert r.status_code == 200, r.text
        job_id = r.json()["id"]
        yield {"app": app, "client": c, "key_a": key_a, "key_b": key_b, "file_id": file_id, "job_id": job_id}
    app.state.engine.dispose()
    drop_database(url)


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_schema_violation(service) -> None:
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_asgi("/openapi.json", service["app"])
    headers = {"Authorization": f"Bearer {service['key_a']}"}
    # objects of its own for the fuzzer to find (it may delete or cancel them)
    c: TestClient = service["client"]
    r = c.post(
        "/v1/files",
        headers=headers,
        data={"purpose": "fine-tune"},
        files={"file": ("f.jsonl", training_jsonl(16), "application/jsonl")},
    )
    file_id = r.json()["id"]
    r = c.post(
        "/v1/fine_tuning/jobs", headers=headers, json={"model": "tiny-llama", "training_file": file_id}
    )
    real_ids = {"file_id": file_id, "fine_tuning_job_id": r.json()["id"]}
    failures: list[str] = []
    ops = 0
    for result in schema.get_all_operations():
        op = result.ok()
        ops += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            checks = [
                not_a_server_error,
                status_code_conformance,
                response_schema_conformance,
                content_type_conformance,
            ]
            if mode is GenerationMode.NEGATIVE:
                checks.append(negative_data_rejection)

            run = _fuzzer(op, mode, headers, checks, real_ids)
            try:
                run()
            except Unsatisfiable:
                continue  # no invalid request exists for it (e.g. only unconstrained string parameters)
            except Exception as e:
                failures.append(f"{op.label} [{mode.value}]: {str(e)[:3000]}")
    assert ops >= 10, "the schema lists the service's operations"
    assert not failures, "\n\n".join(failures)


def _fuzzer(op: Any, mode: Any, headers: dict[str, str], checks: list[Any], real_ids: dict[str, str]) -> Any:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=op.as_strategy(generation_mode=mode), real=st.booleans())
    def run(case: Any, real: bool) -> None:
        if real and case.path_parameters:  # half the time, objects that exist (else it is all 404s)
            for name in list(case.path_parameters):
                if name in real_ids:
                    case.path_parameters[name] = real_ids[name]
        if case.query and str(case.query.get("stream", "")).lower() in ("true", "1", "yes", "on"):
            case.query["stream"] = "false"  # an event stream of a live job never ends by itself
        # The key goes into the case itself (not only onto the wire), so the checks judge what was
        # sent: a negative case whose only fault was a missing or mangled Authorization (bearerAuth is
        # declared) is a valid request once the real key is in, and the other keys are tested below.
        sent = {
            k: v for k, v in (case.headers or {}).items() if k.lower() not in {h.lower() for h in headers}
        }
        case.headers = {**sent, **headers}
        case.call_and_validate(checks=checks)

    return run


def _operations(app: Any) -> list[tuple[str, str]]:
    out = []
    for path, item in app.openapi()["paths"].items():
        for method in item:
            out.append((method.upper(), path))
    return out


PUBLIC = {("GET", "/healthz"), ("GET", "/readyz")}


def _fill(path: str, service: dict[str, Any]) -> str:
    # A fine-tuned model id of team A's job (the job has not run, so no such model is registered yet:
    # every operation on it is "not found", for A's key as for B's).
    ids = {
        "file_id": service["file_id"],
        "fine_tuning_job_id": service["job_id"],
        "model": f"ft:tiny-llama:team-a::{service['job_id']}",
    }
    return re.sub(r"\{(\w+)\}", lambda m: ids[m.group(1)], path)


def test_no_key_and_wrong_key_are_refused_everywhere(service) -> None:
    c: TestClient = service["client"]
    ops = [op for op in _operations(service["app"]) if op not in PUBLIC]
    assert len(ops) >= 10
    bad_headers = [
        {},
        {"Authorization": "Bearer zf-wrong-key-0000000000000000000000000000000000"},
        {"Authorization": f"Bearer {service['key_a']}x"},
        {"Authorization": service["key_a"]},  # no scheme
        {"Authorization": f"Basic {service['key_a']}"},
        {"Authorization": "Bearer "},
    ]
    for method, path in ops:
        for h in bad_headers:
            r = c.request(method, _fill(path, service), headers=h, params={"stream": "false"})
            assert r.status_code == 401, (method, path, h, r.status_code, r.text)
            if method == "HEAD":  # the status and headers of a GET, no body
                assert r.content == b"" and "www-authenticate" in r.headers
                continue
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert service["key_a"] not in r.text  # a key is never echoed back


def test_other_teams_key_is_refused(service) -> None:
    """Team B sees nothing of team A: every object of A is 'not found' for B (no existence leak),
    and B's lists are empty; B cannot cancel A's job or use A's file for its own job."""
    c: TestClient = service["client"]
    hb = {"Authorization": f"Bearer {service['key_b']}"}
    for method, path in _operations(service["app"]):
        if "{" not in path:
            continue
        r = c.request(method, _fill(path, service), headers=hb, params={"stream": "false"})
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        if method == "HEAD":  # the status of a GET, no body
            continue
        assert r.json()["error"]["code"] in ("not_found", "file_not_found", "model_not_found")
    assert c.get("/v1/fine_tuning/jobs", headers=hb).json()["data"] == []
    assert c.get("/v1/files", headers=hb).json()["data"] == []
    r = c.post(
        "/v1/fine_tuning/jobs", headers=hb, json={"model": "tiny-llama", "training_file": service["file_id"]}
    )
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == "training_file", r.text
    # and A still has its objects
    ha = {"Authorization": f"Bearer {service['key_a']}"}
    assert c.get(f"/v1/fine_tuning/jobs/{service['job_id']}", headers=ha).status_code == 200
    assert c.get(f"/v1/files/{service['file_id']}", headers=ha).status_code == 200


def test_revoked_key_is_refused(service, tmp_path: Path) -> None:
    from api.core.auth import create_key, find_team, revoke_key
    from store.db import session_scope

    url = service["app"].state.settings.resolved_database_url
    with session_scope(url) as s:
        row, key = create_key(s, find_team(s, "team-a"), "to-revoke")
        key_id = row.id
    c: TestClient = service["client"]
    h = {"Authorization": f"Bearer {key}"}
    assert c.get("/v1/files", headers=h).status_code == 200
    with session_scope(url) as s:
        revoke_key(s, key_id)
    assert c.get("/v1/files", headers=h).status_code == 401
