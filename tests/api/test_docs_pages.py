"""The API reference at /docs (api/docs_pages.py, api/static/docs/): the vendored Swagger UI from this
origin only, under a strict Content-Security-Policy; FastAPI's CDN pages (/redoc, the OAuth2 redirect)
are gone. The page in a real browser: tests/console/test_console.py."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin

import pytest
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "api" / "static" / "docs"
VENDOR = DOCS / "vendor" / "swagger-ui"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from api.app import create_app
    from api.core.config import ApiSettings
    from store.settings import Settings

    app = create_app(
        Settings(_env_file=None, data_dir=tmp_path_factory.mktemp("zf-docs")),  # type: ignore[call-arg]
        ApiSettings(_env_file=None, migrate_on_start=False),  # type: ignore[call-arg]
    )
    yield TestClient(app)


def _policy(header: str) -> dict[str, list[str]]:
    out = {}
    for part in header.split(";"):
        name, *values = part.split()
        out[name] = values
    return out


def test_the_docs_page_is_ours_under_a_strict_policy(client: TestClient) -> None:
    r = client.get("/docs", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith("/docs/")
    page = client.get("/docs/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = _policy(page.headers["content-security-policy"])
    assert policy["default-src"] == ["'self'"] and policy["script-src"] == ["'self'"]
    assert policy["style-src"] == ["'self'"] and policy["connect-src"] == ["'self'"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["object-src"] == ["'none'"]
    assert policy["img-src"] == ["'self'", "data:"]
    # no third-party origin, no inline or eval'd code anywhere in the policy
    assert not [v for values in policy.values() for v in values if v not in ("'self'", "'none'", "data:")]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer" and page.headers["x-frame-options"] == "DENY"

    html = page.text
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all(
        'src="' in attrs and not body.strip() for attrs, body in scripts
    )  # no inline script
    assert not re.search(r"\son\w+=|\sstyle=|javascript:", html)  # no inline handler or style
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert refs and not [u for u in refs if "//" in u or ":" in u], refs  # this origin only
    for ref in refs:  # each one served; the files under a policy too (the icon is the console's)
        asset = client.get(urljoin("/docs/", ref))
        assert asset.status_code == 200, ref
        if ref == "../openapi.json":  # the document itself, linked for readers without JavaScript
            continue
        assert _policy(asset.headers["content-security-policy"])["script-src"] == ["'self'"], ref
        assert asset.headers["x-content-type-options"] == "nosniff", ref
    assert (
        client.get("/docs/vendor/swagger-ui/swagger-ui-bundle.js")
        .headers["content-type"]
        .startswith("text/javascript")
    )
    assert client.get("/docs/vendor/swagger-ui/LICENSE").text.lstrip().startswith("Apache License")


def test_the_init_script_loads_nothing_from_elsewhere() -> None:
    source = (DOCS / "docs.js").read_text()
    assert "validatorUrl: null" in source  # else Swagger UI loads a badge from validator.swagger.io
    assert not re.search(r"https?://", source)
    assert "persistAuthorization: false" in source


def test_the_vendored_files_are_the_pinned_release() -> None:
    readme = (VENDOR / "README.md").read_text()
    assert "Swagger UI 5.35.0" in readme and "swagger-ui-dist@5.35.0" in readme
    for digest, name in re.findall(r"sha256\s+([0-9a-f]{64})\s+(\S+)", readme):
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
    assert len(re.findall(r"sha256\s+[0-9a-f]{64}", readme)) == 2


def test_fastapis_cdn_pages_are_gone(client: TestClient) -> None:
    for path in ("/redoc", "/docs/oauth2-redirect"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert client.get("/docs/nope.js").status_code == 404
    assert client.get("/openapi.json").json()["info"]["title"] == "ZenFlow fine-tuning API"


def test_the_console_sends_its_policy(client: TestClient) -> None:
    for path in ("/console/", "/console/js/app.js", "/console/console.css"):
        r = client.get(path)
        assert r.status_code == 200, path
        policy = _policy(r.headers["content-security-policy"])
        assert policy["script-src"] == ["'self'"] and policy["frame-ancestors"] == ["'none'"], path
        assert not [v for values in policy.values() for v in values if v not in ("'self'", "'none'")], path
        assert (
            r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"
        )


def test_the_root_leads_a_browser_to_the_console(client: TestClient) -> None:
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/console/"
    assert client.head("/", follow_redirects=False).status_code == 307
    assert "/" not in client.get("/openapi.json").json()["paths"]
