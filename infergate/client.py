"""One typed HTTP client for infergate (and any KServe V2 server), used by the CLI,
the dashboard and bench. Tensors go as binary data by default.

This module is the client itself: its requests, and how an answer that is an error, or
not what an infergate server sends, becomes one ClientError line. Beside it, and
importable from here as before: client_address (the server's URL, tokens, the paths built
from names), client_codec (the V2 inference bodies) and client_errors (the errors and
their one-line wording)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import orjson

from infergate.client_address import (
    DEFAULT_URL,
    PROJECT_PROFILE,
    check_token,
    default_url,
    model_path,
    normalize_url,
    project_port,
    project_profile_unread,
    segment,
)
from infergate.client_codec import InferResponse, decode_infer_response, encode_infer_request
from infergate.client_errors import (
    MAX_ERROR_CHARS,
    MAX_SERVER_ERROR_CHARS,
    ClientError,
    UrlError,
    error_text,
    json_kind,
    one_line,
)

if TYPE_CHECKING:
    from infergate.tensors import Array

__all__ = [
    "DEFAULT_URL",
    "MAX_ERROR_CHARS",
    "MAX_SERVER_ERROR_CHARS",
    "PROJECT_PROFILE",
    "Client",
    "ClientError",
    "InferResponse",
    "UrlError",
    "check_token",
    "decode_infer_response",
    "default_url",
    "encode_infer_request",
    "error_text",
    "model_path",
    "normalize_url",
    "one_line",
    "project_port",
    "project_profile_unread",
    "segment",
]


class Client:
    def __init__(
        self, url: str | None = None, token: str | None = None, timeout_s: float = 30.0
    ) -> None:
        """UrlError for an address that is not one, or a token that cannot be sent."""
        headers = {}
        if token:  # the caller picks the token: a tenant's key or an admin key
            check_token(token)
            headers["Authorization"] = f"Bearer {token}"
        self.url = normalize_url(url) if url else default_url()
        self.auth_headers = headers
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise ClientError(0, self._unreachable(method, path, exc)) from None
        if 300 <= response.status_code < 400:
            where = response.headers.get("location")
            raise ClientError(
                response.status_code,
                f"{self.url} answered {method} {path} with a redirect"
                + (f" to {one_line(where)}" if where else "")
                + ", which infergate does not follow. Hint: give the server's own address "
                "as --url or INFERGATE_URL",
            )
        if response.status_code >= 400:
            raise ClientError(
                response.status_code, error_text(response.content, response.reason_phrase)
            )
        return response

    def _unreachable(self, method: str, path: str, exc: Exception) -> str:
        """Why a request got no answer, in one line: refused, timed out, cut off, TLS."""
        said = one_line(str(exc) or type(exc).__name__).rstrip(".")
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return (
                f"{self.url} did not answer {method} {path} within {self.timeout_s:g} s "
                f"({type(exc).__name__})"
            )
        if isinstance(exc, httpx.RemoteProtocolError):
            return (
                f"{self.url} broke off its answer to {method} {path} ({said}). Hint: is it an "
                "infergate server, and is anything in between (a proxy) cutting answers?"
            )
        if isinstance(exc, httpx.ConnectError) and "SSL" in said.upper():
            return (
                f"cannot reach infergate at {self.url}: the TLS handshake failed ({said}). "
                "Hint: `infergate serve` speaks plain HTTP: use http:// unless a TLS proxy "
                "is in front"
            )
        unread = project_profile_unread() if self.url == DEFAULT_URL else None
        return (
            f"cannot reach infergate at {self.url}: {said}. Hint: is `infergate serve` "
            "running? Set --url or INFERGATE_URL" + (f" ({unread})" if unread else "")
        )

    def _json(self, method: str, path: str, expect: type | None = None, **kwargs: Any) -> Any:
        """The answer's JSON; ClientError when it is not JSON, or not of the `expect`ed
        kind (an object, an array) that an infergate server sends."""
        response = self._request(method, path, **kwargs)
        try:
            doc = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            what = (
                f"a body that is not JSON: {error_text(response.content)[:80]!r}"
                if response.content.strip()
                else "an empty body"
            )
            raise ClientError(response.status_code, self._odd(method, path, what)) from None
        if expect is not None and not isinstance(doc, expect):
            wanted = "an object" if expect is dict else "an array"
            raise ClientError(
                response.status_code,
                self._odd(method, path, f"{json_kind(doc)} where infergate sends {wanted}"),
            )
        return doc

    def _odd(self, method: str, path: str, what: str) -> str:
        return (
            f"{self.url} answered {method} {path} with {one_line(what)}. Hint: is it an "
            "infergate server (of this version)? Check --url or INFERGATE_URL"
        )

    def _records(self, method: str, path: str, doc: Any, where: str = "") -> list[dict[str, Any]]:
        """`doc` (an array) when every item is an object; ClientError otherwise."""
        if not isinstance(doc, list) or not all(isinstance(x, dict) for x in doc):
            got = json_kind(doc) if not isinstance(doc, list) else "an array of other things"
            raise ClientError(
                200, self._odd(method, path, f"{got}{where} where infergate sends objects")
            )
        return doc

    def live(self) -> bool:
        try:
            return self._http.get("/v2/health/live").status_code == 200
        except httpx.HTTPError:
            return False

    def ready(self) -> bool:
        try:
            return self._http.get("/v2/health/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def server_metadata(self) -> dict[str, Any]:
        return self._json("GET", "/v2", dict)  # type: ignore[no-any-return]

    def models(self) -> list[dict[str, Any]]:
        path = "/admin/models"
        return self._records("GET", path, self._json("GET", path, list))

    def model(self, name: str) -> dict[str, Any]:
        return self._json("GET", f"/admin/models/{segment(name)}", dict)  # type: ignore[no-any-return]

    def metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """A model's V2 metadata, its `inputs` checked: each with a name, a known datatype
        and a shape of integers (what `infer` and `bench` build requests from)."""
        from infergate.tensors import V2_TO_NUMPY

        path = model_path(name, version)
        doc: dict[str, Any] = self._json("GET", path, dict)
        inputs = self._records("GET", path, doc.get("inputs") or [], " in its inputs")
        for t in inputs:
            name_ok = isinstance(t.get("name"), str)
            shape = t.get("shape")
            shape_ok = isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape
            )
            if not name_ok or t.get("datatype") not in V2_TO_NUMPY or not shape_ok:
                raise ClientError(
                    200,
                    self._odd(
                        "GET", path, f"an input that is not a name, a V2 datatype and a shape: {t}"
                    ),
                )
        return doc

    def repository_index(self) -> list[dict[str, Any]]:
        return self._json("POST", "/v2/repository/index", list)  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return self._json("GET", "/admin/stats", dict)  # type: ignore[no-any-return]

    def tenants(self) -> dict[str, Any]:
        path = "/admin/tenants"
        doc: dict[str, Any] = self._json("GET", path, dict)
        self._records("GET", path, doc.get("tenants"), " for its tenants")
        return doc

    def add_tenant(self, name: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self._json(  # type: ignore[no-any-return]
            "POST", "/admin/tenants", dict, content=orjson.dumps({"name": name, **settings})
        )

    def set_tenant(self, name: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self._json(  # type: ignore[no-any-return]
            "PATCH",
            f"/admin/tenants/{segment(name)}",
            dict,
            content=orjson.dumps(settings),
        )

    def remove_tenant(self, name: str) -> None:
        self._request("DELETE", f"/admin/tenants/{segment(name)}")

    def breakers(self) -> list[dict[str, Any]]:
        path = "/admin/breakers"
        return self._records("GET", path, self._json("GET", path, list))

    def set_breaker(self, model: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self._json(  # type: ignore[no-any-return]
            "PATCH",
            f"/admin/breakers/{segment(model)}",
            dict,
            content=orjson.dumps(settings),
        )

    def reset_breaker(self, model: str) -> None:
        self._request("POST", f"/admin/breakers/{segment(model)}/reset")

    def _no_read_timeout(self) -> httpx.Timeout:
        """For a call that waits as long as the server works (a load): no limit on the
        answer, but one on connecting, so that an address nothing answers at still fails."""
        return httpx.Timeout(None, connect=self.timeout_s)

    def load_model(self, name: str) -> None:
        """Load or reload `name` from disk; returns once it serves (or raises why not)."""
        self._request(
            "POST",
            f"/v2/repository/models/{segment(name)}/load",
            timeout=self._no_read_timeout(),
        )

    def unload_model(self, name: str) -> None:
        """Drain and stop `name`; returns once its workers have exited."""
        self._request(
            "POST",
            f"/v2/repository/models/{segment(name)}/unload",
            timeout=self._no_read_timeout(),
        )

    def infer(
        self,
        model: str,
        inputs: dict[str, Array],
        version: str | None = None,
        outputs: list[str] | None = None,
        binary: bool = True,
        parameters: dict[str, Any] | None = None,
    ) -> InferResponse:
        body, headers = encode_infer_request(inputs, outputs, binary, parameters=parameters)
        return self.infer_raw(model, body, headers, version)

    def infer_raw(
        self, model: str, body: bytes, headers: dict[str, str], version: str | None = None
    ) -> InferResponse:
        path = model_path(model, version) + "/infer"
        response = self._request("POST", path, content=body, headers=headers)
        try:
            return decode_infer_response(
                response.content, response.headers.get("inference-header-content-length")
            )
        except ValueError as exc:
            raise ClientError(
                response.status_code,
                self._odd("POST", path, f"something that is not a V2 inference response ({exc})"),
            ) from None
