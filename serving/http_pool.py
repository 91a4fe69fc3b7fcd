"""An HTTP connection pool to an upstream (vLLM, the serving process), made on first use: an
``httpx.AsyncClient`` belongs to the event loop it was made in, and the app's loop runs only once it
serves, so the pool is made then, and again after :meth:`LazyPool.aclose`."""

from __future__ import annotations

from typing import Any

import httpx


class LazyPool:
    def __init__(self, base_url: str, **client_args: Any) -> None:
        self._args: dict[str, Any] = {"base_url": base_url.rstrip("/"), **client_args}
        self._http: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(**self._args)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
