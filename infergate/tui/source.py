"""Where the dashboard's data comes from: a server over HTTP, or a fixed document (tests).

Besides /admin/stats, the HTTP source reads /admin/tenants (rejections by reason) and the
request duration histogram on /metrics (each tenant's latency), and puts them in the
document as `tenant_details` and `tenant_latency`."""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

import httpx
import orjson

from infergate.client import error_text

REQUEST_SECONDS = "infergate_request_duration_seconds_bucket"


class StatsSource(Protocol):
    label: str

    async def fetch(self) -> dict[str, Any]: ...

    async def reset_breaker(self, model: str) -> None: ...

    async def load(self, model: str) -> None: ...

    async def unload(self, model: str) -> None: ...

    async def close(self) -> None: ...


class SourceError(Exception):
    """The server could not be reached (status 0) or refused; the message is for the status
    line."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def tenant_buckets(metrics_text: str) -> dict[str, dict[float, float]]:
    """Per tenant, the cumulative request duration histogram (le -> count), summed over
    models."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == REQUEST_SECONDS:
                tenant = sample.labels.get("tenant", "-")
                le = float(sample.labels.get("le", "inf"))
                buckets = out.setdefault(tenant, {})
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return out


class HttpSource:
    def __init__(self, url: str, token: str | None) -> None:
        self.label = url
        self._sends_token = bool(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=url, headers=headers, timeout=5.0)

    async def _call(self, method: str, path: str, timeout: float | None = 5.0) -> Any:
        response = await self._raw(method, path, timeout)
        if not response.content:
            return None
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError:
            raise SourceError(
                f"not JSON at {path}: not an infergate server?",
                response.status_code,
            ) from None

    async def _raw(self, method: str, path: str, timeout: float | None = 5.0) -> httpx.Response:
        try:
            response = await self._http.request(method, path, timeout=timeout)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise SourceError(f"cannot reach {self.label} ({type(exc).__name__})") from None
        if response.status_code in (401, 403):
            raise SourceError(self._refused(response.status_code), response.status_code)
        if 300 <= response.status_code < 400:
            raise SourceError(
                f"{response.status_code}: a redirect; give the server's own address",
                response.status_code,
            )
        if response.status_code >= 400:
            message = error_text(response.content, response.reason_phrase)
            raise SourceError(f"{response.status_code}: {message}", response.status_code)
        return response

    def _refused(self, status: int) -> str:
        """Short enough for an 80-column status line, and true whether a token was sent
        or not (the server's own message, with its hint for the CLI, is neither)."""
        if self._sends_token:
            return f"{status}: the server refused the token: check --token or INFERGATE_ADMIN_TOKEN"
        return f"{status}: an admin key is needed: give --token or set INFERGATE_ADMIN_TOKEN"

    async def fetch(self) -> dict[str, Any]:
        doc = await self._call("GET", "/admin/stats")
        if not isinstance(doc, dict):  # an empty answer, a list: not infergate's statistics
            raise SourceError("no statistics at /admin/stats: not an infergate server?")
        try:  # extras: a server without them still shows everything else
            tenants = await self._call("GET", "/admin/tenants")
            doc["tenant_details"] = tenants.get("tenants", []) if isinstance(tenants, dict) else []
            metrics = await self._raw("GET", "/metrics")
            doc["tenant_latency"] = tenant_buckets(metrics.text)
        except (SourceError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            pass  # (what prometheus_client's parser raises on a page it cannot read)
        return doc

    async def reset_breaker(self, model: str) -> None:
        await self._call("POST", f"/admin/breakers/{quote(model, safe='')}/reset")

    async def load(self, model: str) -> None:
        await self._call(
            "POST", f"/v2/repository/models/{quote(model, safe='')}/load", timeout=None
        )

    async def unload(self, model: str) -> None:
        path = f"/v2/repository/models/{quote(model, safe='')}/unload"
        await self._call("POST", path, timeout=None)

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
