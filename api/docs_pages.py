"""The API reference at ``/docs``: Swagger UI on ``/openapi.json``, every byte from this origin.

FastAPI's own ``/docs`` and ``/redoc`` pull their scripts from a CDN, with no integrity check and no
Content-Security-Policy, on the origin where the console keeps a team's key: whoever serves (or
tampers with) that script reads the key. So the app turns them off and serves instead the vendored,
pinned Swagger UI (``api/static/docs/vendor/swagger-ui/``, version, licence and checksums in its
README) with a page and an init script of ours (no inline script or style), under a policy that
allows scripts, styles and requests from this origin only; ``img-src`` adds ``data:`` (Swagger UI's
icons are data-URI SVGs in its CSS), nothing else.

``/redoc`` is not served (it answers 404). Redoc 3.0.1's standalone bundle, tried under this policy
in Chromium, renders nothing: it injects its styles as inline ``<style>`` elements at run time
(styled-components; only a per-response nonce would let them through), and once allowed it sends
telemetry to Redocly's collector and loads its logo from Redocly's CDN. Swagger UI shows the same
document; a second 2 MB third-party bundle that phones home is not worth keeping current for it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from api.console import SecureFiles, security_headers

DOCS_DIR = Path(__file__).resolve().parent / "static" / "docs"
DOCS_PATH = "/docs"

DOCS_CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)


def install_docs(app: FastAPI, path: str = DOCS_PATH) -> None:
    """Serve Swagger UI at ``path``: ``/docs/`` is its page (the router redirects ``/docs`` there).
    The app must be built with ``docs_url=None, redoc_url=None`` (FastAPI's CDN pages)."""
    app.mount(
        path,
        SecureFiles(directory=DOCS_DIR, headers=security_headers(DOCS_CONTENT_SECURITY_POLICY)),
        name="docs",
    )
