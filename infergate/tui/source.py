"""Where the dashboard's data comes from: a server over HTTP, or a fixed document (tests)."""

from __future__ import annotations

from typing import Any, Protocol

import httpx
import orjson


class StatsSource(Protocol):
    label: str

    async def fetch(self) -> dict[str, Any]: ...

    async def reset_breaker(self, model: str) -> None: ...

    async def load(self, model: str) -> None: ...

    async def unload(self, model: str) -> None: ...

    async def close(self) -> None: ...


class SourceError(Exception):
    """The server could not be reached or refused; the message is for the status line."""


class HttpSource:
    def __init__(self, url: str, token: str | None) -> None:
        self.label = url
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=url, headers=headers, timeout=5.0)

    async def _call(self, method: str, path: str, timeout: float | None = 5.0) -> Any:
        try:
            response = await self._http.request(method, path, timeout=timeout)
        except httpx.HTTPError as exc:
            raise SourceError(f"cannot reach {self.label}: {type(exc).__name__}") from None
        if response.status_code >= 400:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            raise SourceError(f"{response.status_code}: {message}")
        return orjson.loads(response.content) if response.content else None

    async def fetch(self) -> dict[str, Any]:
        doc = await self._call("GET", "/admin/stats")
        return doc if isinstance(doc, dict) else {}

    async def reset_breaker(self, model: str) -> None:
        await self._call("POST", f"/admin/breakers/{model}/reset")

    async def load(self, model: str) -> None:
        await self._call("POST", f"/v2/repository/models/{model}/load", timeout=None)

    async def unload(self, model: str) -> None:
        await self._call("POST", f"/v2/repository/models/{model}/unload", timeout=None)

    async def close(self) -> None:
        await self._http.aclose()


class FixedSource:
    """A fixed stats document: for snapshot tests and demos."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.label = "fixed data"
        self.doc = doc
        self.actions: list[tuple[str, str]] = []

    async def fetch(self) -> dict[str, Any]:
        return self.doc

    async def reset_breaker(self, model: str) -> None:
        self.actions.append(("reset", model))

    async def load(self, model: str) -> None:
        self.actions.append(("load", model))

    async def unload(self, model: str) -> None:
        self.actions.append(("unload", model))

    async def close(self) -> None:
        pass
