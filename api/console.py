"""The self-serve console at ``/console``: static files (``api/static/console/``, plain ES modules, no
build step) that call the public API from the browser with the key the user pastes.

Served by Starlette's ``StaticFiles`` with a strict Content-Security-Policy on every response: scripts,
styles and requests only from this origin, no inline script or style, no plugins, no framing. The page
itself renders server text with ``textContent`` only, so the policy is a second line, not the first.
The API reference pages (``/docs``, api.docs_pages) are served the same way, under their own policy.

Views (hash routes, js/router.js; one page, so every view is a link): ``#/jobs`` the create form (by
method: supervised, DPO, reinforcement with its grader checked first; files of the method's kind) and the
runs table by run name (compare the ticked runs' curves on one chart), ``#/jobs/<id>`` one job (the
method's charts first, with smoothing and log scale; hyperparameters as resolved, data, duration and
estimated finish, plan in readable units, checkpoints, events by level), ``#/files`` and
``#/files/<id>`` datasets (upload; one file's check, problems by line, length histogram, first examples
with the learned turns marked), ``#/models`` (checkpoints under their model; download and delete the
team's own), ``#/chat`` (streamed chat, and two models side by side), ``#/quotas``. Deletes ask in a
``<dialog>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import RedirectResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

#: Where the console's files are (shipped as package data of ``api``).
CONSOLE_DIR = Path(__file__).resolve().parent / "static" / "console"
#: The URL path it is served at.
CONSOLE_PATH = "/console"

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)


def security_headers(policy: str) -> dict[str, str]:
    """What every page of ours carries: its CSP, no MIME sniffing, no referrer, no framing."""
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        # Revalidate on every load (ETag / Last-Modified make that cheap): a new release is seen at once.
        "Cache-Control": "no-cache",
    }


SECURITY_HEADERS = security_headers(CONTENT_SECURITY_POLICY)


class SecureFiles(StaticFiles):
    """``StaticFiles`` whose every file (the index included) carries ``headers``; a missing file is the
    API's usual 404 error object."""

    def __init__(self, *, directory: Path, headers: Mapping[str, str], html: bool = True) -> None:
        super().__init__(directory=directory, html=html)
        self.extra_headers = dict(headers)

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(self.extra_headers)
        return response


def install_console(app: FastAPI, path: str = CONSOLE_PATH) -> None:
    """Serve the console at ``path``: ``/console/`` is index.html (the router redirects ``/console`` there),
    and ``/``, where a browser pointed at the server lands, redirects to it."""
    app.mount(path, SecureFiles(directory=CONSOLE_DIR, headers=SECURITY_HEADERS), name="console")

    async def root() -> RedirectResponse:
        return RedirectResponse(f"{path}/")

    app.add_api_route("/", root, methods=["GET", "HEAD"], include_in_schema=False)
