"""The self-serve console at ``/console``: static files (``api/static/console/``, plain ES modules, no
build step) that call the public API from the browser with the key the user pastes.

Served by Starlette's ``StaticFiles`` with a strict Content-Security-Policy on every response: scripts,
styles and requests only from this origin, no inline script or style, no plugins, no framing. The page
itself renders server text with ``textContent`` only, so the policy is a second line, not the first.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response
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
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Revalidate on every load (ETag / Last-Modified make that cheap): a new release is seen at once.
    "Cache-Control": "no-cache",
}


class ConsoleFiles(StaticFiles):
    """``StaticFiles`` whose every file (the index included) carries SECURITY_HEADERS; a missing file is
    the API's usual 404 error object."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def install_console(app: FastAPI, path: str = CONSOLE_PATH) -> None:
    """Serve the console at ``path``: ``/console/`` is index.html (the router redirects ``/console`` there)."""
    app.mount(path, ConsoleFiles(directory=CONSOLE_DIR, html=True), name="console")
