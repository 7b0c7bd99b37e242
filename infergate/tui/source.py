"""Where the dashboard's data comes from: a server over HTTP, or a fixed document (tests).

Besides /admin/stats, the HTTP source reads /admin/tenants (rejections by reason) and the
request duration histogram on /metrics (each tenant's latency), and puts them in the
document as `tenant_details` and `tenant_latency`.

Each request has one deadline for the whole of it (httpx's timeouts are per read: a server
that sends a byte now and then was waited on without end), and its answer is read up to
the CLI's cap on a document (MAX_DOCUMENT_BYTES), refused past it. The CLI's client is
synchronous, its deadline a timer that shuts a socket down; here a poll is a coroutine,
which a deadline cancels."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol
from urllib.parse import quote

import httpx
import orjson

from infergate.client_address import tls_verify_for
from infergate.client_codec import MAX_DOCUMENT_BYTES, MAX_ERROR_BODY_BYTES
from infergate.client_errors import error_text

REQUEST_SECONDS = "infergate_request_duration_seconds_bucket"
# Of a whole request: a poll comes every second, and a server slower than this is said
# to be so (it was the per-read timeout, which a dripping answer never ran into).
POLL_TIMEOUT_S = 5.0
_LENGTH_DIGITS = 18  # a longer Content-Length is past any cap (and int() of it is slow)


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
    def __init__(
        self,
        url: str,
        token: str | None,
        timeout_s: float = POLL_TIMEOUT_S,
        max_answer_bytes: int = MAX_DOCUMENT_BYTES,
    ) -> None:
        """`timeout_s` bounds each whole request (a load or unload: from its answer's
        head on), `max_answer_bytes` each answer's body."""
        self.label = url
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self._sends_token = bool(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # (connecting has its own limit, as in the CLI, for a load that waits: see _read)
        timeout = httpx.Timeout(None, connect=timeout_s)
        verify = tls_verify_for(url)  # UrlError for https whose trust store cannot load
        self._http = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=timeout, verify=verify
        )

    async def _call(self, method: str, path: str, patient: bool = False) -> Any:
        content = await self._read(method, path, patient)
        if not content:
            return None
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError:
            raise SourceError(f"not JSON at {path}: not an infergate server?") from None

    async def _read(self, method: str, path: str, patient: bool = False) -> bytes:
        """The body of a 2xx answer, whole within `timeout_s` of sending (`patient`: of
        its head, for a call that waits as long as the server works) and at most
        `max_answer_bytes`; SourceError for anything else, in a line for the status."""
        loop = asyncio.get_running_loop()
        answered = False
        try:
            async with asyncio.timeout(None if patient else self.timeout_s) as deadline:
                async with self._http.stream(method, path) as response:
                    answered = True
                    if patient:
                        deadline.reschedule(loop.time() + self.timeout_s)
                    self._check_status(response)
                    return await self._body(response, path, self.max_answer_bytes)
        except TimeoutError:
            raise SourceError(self._too_slow(path, answered)) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise SourceError(f"cannot reach {self.label} ({type(exc).__name__})") from None

    def _too_slow(self, path: str, answered: bool) -> str:
        if not answered:
            return f"no answer at {path} within {self.timeout_s:g} s"
        return f"no whole answer at {path} within {self.timeout_s:g} s: a stalled server or proxy?"

    def _check_status(self, response: httpx.Response) -> None:
        """SourceError for a status that is no answer: a refusal, a redirect, an error."""
        status = response.status_code
        if status in (401, 403):
            raise SourceError(self._refused(status), status)
        if 300 <= status < 400:
            raise SourceError(f"{status}: a redirect; give the server's own address", status)

    async def _body(self, response: httpx.Response, path: str, limit: int) -> bytes:
        """At most `limit` bytes of the body (as it unpacks: gzip counts unpacked), an
        error status's start as its SourceError; SourceError past the limit."""
        status = response.status_code
        if status >= 400:
            said = await _read_up_to(response, MAX_ERROR_BODY_BYTES)
            raise SourceError(f"{status}: {error_text(said, response.reason_phrase)}", status)
        declared = response.headers.get("content-length", "")
        too_large = SourceError(
            f"more than {limit / 2**20:g} MB at {path}: not an infergate server?", status
        )
        unpacked = bool(response.headers.get("content-encoding"))  # (its length is packed)
        if declared.isdigit() and not unpacked and _past(declared, limit):
            raise too_large
        body = await _read_up_to(response, limit + 1)
        if len(body) > limit:
            raise too_large
        return body

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
            metrics = await self._read("GET", "/metrics")
            doc["tenant_latency"] = tenant_buckets(metrics.decode("utf-8", "replace"))
        except (SourceError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            pass  # (what prometheus_client's parser raises on a page it cannot read)
        return doc

    async def reset_breaker(self, model: str) -> None:
        await self._call("POST", f"/admin/breakers/{quote(model, safe='')}/reset")

    async def load(self, model: str) -> None:
        path = f"/v2/repository/models/{quote(model, safe='')}/load"
        await self._call("POST", path, patient=True)

    async def unload(self, model: str) -> None:
        path = f"/v2/repository/models/{quote(model, safe='')}/unload"
        await self._call("POST", path, patient=True)

    async def close(self) -> None:
        await self._http.aclose()


def _past(declared: str, limit: int) -> bool:
    """Whether a Content-Length of digits says more than `limit` bytes."""
    return len(declared) > _LENGTH_DIGITS or int(declared) > limit


async def _read_up_to(response: httpx.Response, limit: int) -> bytes:
    """The body's first `limit` bytes (as it unpacks); reading stops there."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


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
