"""One typed HTTP client for infergate (and any KServe V2 server), used by the CLI,
the dashboard and bench. Tensors go as binary data by default.

This module is the client itself: its requests, and how an answer that is an error, or
not what an infergate server sends, becomes one ClientError line. Beside it, and
importable from here as before: client_address (the server's URL, tokens, the paths built
from names), client_codec (the V2 inference bodies) and client_errors (the errors and
their one-line wording)."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

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
    tls_verify_for,
)
from infergate.client_codec import (
    MAX_ANSWER_MB,
    MAX_DOCUMENT_BYTES,
    MAX_ERROR_BODY_BYTES,
    InferResponse,
    decode_infer_response,
    encode_infer_request,
)
from infergate.client_errors import (
    MAX_ERROR_CHARS,
    MAX_SERVER_ERROR_CHARS,
    ClientError,
    UrlError,
    error_text,
    is_infergate_error,
    json_kind,
    one_line,
)

if TYPE_CHECKING:
    from infergate.tensors import Array

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "MAX_ANSWER_MB",
    "MAX_DOCUMENT_BYTES",
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


DEFAULT_TIMEOUT_S = 30.0  # for a whole request: connecting, sending, the answer, all of it
MAX_DIMS = 32  # of an input's shape in a model's metadata (numpy's limit, before 2.0)


@dataclass(frozen=True)
class Answer:
    """A server's answer, read whole (and within the limits)."""

    status: int
    headers: httpx.Headers
    content: bytes


class _Deadline:
    """One limit on a whole request. httpx's timeouts are per read, so a server that sends
    a byte every few seconds was waited for without end; at the deadline the request's
    connection is shut down, which ends the read or write in progress at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self.answered = False  # the answer's head came
        self.received = 0  # bytes of the answer's body
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def stop(self) -> None:
        self._timer.cancel()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace hook: the request's socket, as soon as it is connected (to the
        server, or to a proxy: `connection.` or `socks.connect_tcp.complete`), and again
        once TLS wraps it (`.start_tls.complete`: the wrapping detaches the first socket
        object, whose shutdown then fails with EBADF, and a TLS answer was not cut off)."""
        if event.endswith((".connect_tcp.complete", ".start_tls.complete")) and info.get(
            "return_value"
        ):
            sock = info["return_value"].get_extra_info("socket")
            with self._lock:
                self._socket = sock
                if self.expired:
                    self._shut_down()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            self._shut_down()

    def _shut_down(self) -> None:
        # socket.socket's shutdown, even for an SSLSocket: its own would drop the TLS
        # state under the thread that is reading.
        if isinstance(self._socket, socket.socket):
            with contextlib.suppress(OSError):  # closed already
                socket.socket.shutdown(self._socket, socket.SHUT_RDWR)


def _read_up_to(response: httpx.Response, limit: int, deadline: _Deadline) -> tuple[bytes, bool]:
    """At most `limit` bytes of the answer's body (decoded: a gzip answer counts as it
    unpacks), and whether it held more; reading stops there."""
    parts: list[bytes] = []
    for chunk in response.iter_bytes():
        parts.append(chunk)
        deadline.received += len(chunk)
        if deadline.received > limit:
            return b"".join(parts)[:limit], True
    return b"".join(parts), False


class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout_s: float | None = None,
        max_answer_mb: int = MAX_ANSWER_MB,
    ) -> None:
        """UrlError for an address that is not one, or a token that cannot be sent.
        `timeout_s` (DEFAULT_TIMEOUT_S) bounds each whole request; `max_answer_mb` the
        answer to an inference (`infergate infer --max-answer-mb` raises it)."""
        headers = {}
        if token:  # the caller picks the token: a tenant's key or an admin key
            check_token(token)
            headers["Authorization"] = f"Bearer {token}"
        self.url = normalize_url(url) if url else default_url()
        self.auth_headers = headers
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.max_answer_mb = max_answer_mb
        # A connection per request (a command makes one or two): the deadline's trace hook
        # sees each connect, so it can shut down the socket of any request.
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=self.timeout_s,
            limits=httpx.Limits(max_keepalive_connections=0),
            verify=tls_verify_for(self.url),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        limit: int = MAX_DOCUMENT_BYTES,
        patient: bool = False,
        **kwargs: Any,
    ) -> Answer:
        """The answer, whole within `timeout_s` of sending (`patient`: of its head, for a
        call that waits as long as the server works) and at most `limit` bytes; ClientError
        for anything else: an error status, a redirect, no answer, one too slow or large."""
        deadline = _Deadline(self.timeout_s)
        if not patient:
            deadline.start()
        try:
            with self._http.stream(
                method, path, extensions={"trace": deadline.trace}, **kwargs
            ) as response:
                deadline.answered = True
                if patient:
                    deadline.start()
                return self._answer(method, path, response, limit, deadline)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise ClientError(0, self._unreachable(method, path, exc, deadline)) from None
        finally:
            deadline.stop()

    def _answer(
        self, method: str, path: str, response: httpx.Response, limit: int, deadline: _Deadline
    ) -> Answer:
        status = response.status_code
        if 300 <= status < 400:
            where = response.headers.get("location")
            raise ClientError(
                status,
                f"{self.url} answered {method} {path} with a redirect"
                + (f" to {one_line(where)}" if where else "")
                + ", which infergate does not follow. Hint: give the server's own address "
                "as --url or INFERGATE_URL",
            )
        if status >= 400:
            said, _ = _read_up_to(response, MAX_ERROR_BODY_BYTES, deadline)
            text = error_text(said, response.reason_phrase)
            # A proxy's page, another server at that URL; not a bare 500 (uvicorn's own,
            # should infergate's app ever fail without its JSON)
            bare = status >= 500 and text == response.reason_phrase
            if not is_infergate_error(said) and not bare:
                text = (
                    f"{self.url} answered {method} {path} with an error that is not "
                    f"infergate's: {text}. Hint: is --url (or INFERGATE_URL) an infergate "
                    "server, or a proxy in front of one?"
                )
            raise ClientError(status, text)
        declared = response.headers.get("content-length", "")
        if (
            declared.isdigit()
            and int(declared) > limit
            and not response.headers.get("content-encoding")
        ):
            why = f"its Content-Length says {int(declared)} bytes"
            raise ClientError(status, self._too_large(method, path, limit, why))
        body, more = _read_up_to(response, limit, deadline)
        if more:
            raise ClientError(status, self._too_large(method, path, limit, "it went on past that"))
        return Answer(status, response.headers, body)

    def _too_large(self, method: str, path: str, limit: int, why: str) -> str:
        hint = (
            "Hint: if the model's outputs are that large, raise infergate infer's --max-answer-mb"
            if path.endswith("/infer")
            else "Hint: is it an infergate server (of this version)? Check --url or INFERGATE_URL"
        )
        return (
            f"{self.url} answered {method} {path} with more than {limit / 2**20:g} MB "
            f"({why}), which is not read. {hint}"
        )

    def _unreachable(self, method: str, path: str, exc: Exception, deadline: _Deadline) -> str:
        """Why a request got no answer, in one line: refused, timed out, cut off, TLS."""
        said = one_line(str(exc) or type(exc).__name__).rstrip(".")
        # (at the deadline the socket is shut down: the error is then a cut connection)
        timed_out = deadline.expired or isinstance(exc, httpx.TimeoutException)
        if timed_out and not isinstance(exc, httpx.ConnectTimeout):
            # An inference may take longer for good reasons: a slow model, a large answer.
            longer = (
                " Hint: a model that runs longer, or a large answer on a slow link, needs "
                "infergate infer --timeout"
                if path.endswith("/infer")
                else " Hint: is it an infergate server, and is anything in between (a "
                "proxy) stalling answers?"
            )
            if not deadline.answered:
                return (
                    f"{self.url} did not answer {method} {path} within {self.timeout_s:g} s."
                    + longer
                )
            return (
                f"{self.url} did not finish its answer to {method} {path} within "
                f"{self.timeout_s:g} s (it had sent {deadline.received} bytes of it)." + longer
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
        if urlsplit(self.url).port is None:  # `--url 127.0.0.1`: port 80, not serve's
            default = 443 if self.url.startswith("https:") else 80
            unread = f"it names no port, so port {default}; `infergate serve` listens on 8000"
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
            raise ClientError(response.status, self._odd(method, path, what)) from None
        if expect is not None and not isinstance(doc, expect):
            wanted = "an object" if expect is dict else "an array"
            raise ClientError(
                response.status,
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

    def _healthy(self, path: str) -> bool:
        try:
            return self._request("GET", path).status == 200
        except ClientError:
            return False

    def live(self) -> bool:
        return self._healthy("/v2/health/live")

    def ready(self) -> bool:
        return self._healthy("/v2/health/ready")

    def server_metadata(self) -> dict[str, Any]:
        return self._json("GET", "/v2", dict)  # type: ignore[no-any-return]

    def models(self) -> list[dict[str, Any]]:
        path = "/admin/models"
        return self._records("GET", path, self._json("GET", path, list))

    def model(self, name: str) -> dict[str, Any]:
        return self._json("GET", f"/admin/models/{segment(name)}", dict)  # type: ignore[no-any-return]

    def metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """A model's V2 metadata, its `inputs` checked: each with a name, a known datatype
        and a shape of at most MAX_DIMS integers (what `infer` and `bench` build requests
        from)."""
        from infergate.tensors import V2_TO_NUMPY

        path = model_path(name, version)
        doc: dict[str, Any] = self._json("GET", path, dict)
        inputs = self._records("GET", path, doc.get("inputs") or [], " in its inputs")
        for t in inputs:
            name_ok = isinstance(t.get("name"), str)
            shape = t.get("shape")
            shape_ok = (
                isinstance(shape, list)
                and len(shape) <= MAX_DIMS
                and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            )
            if not name_ok or t.get("datatype") not in V2_TO_NUMPY or not shape_ok:
                raise ClientError(
                    200,
                    self._odd(
                        "GET",
                        path,
                        "an input that is not a name, a V2 datatype and a shape (of at most "
                        f"{MAX_DIMS} dimensions): {t}",
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
        answer's head, but one on connecting, so that an address nothing answers at still
        fails (and, as `patient`, the deadline from the head on)."""
        return httpx.Timeout(None, connect=self.timeout_s)

    def load_model(self, name: str) -> None:
        """Load or reload `name` from disk; returns once it serves (or raises why not)."""
        self._request(
            "POST",
            f"/v2/repository/models/{segment(name)}/load",
            patient=True,
            timeout=self._no_read_timeout(),
        )

    def unload_model(self, name: str) -> None:
        """Drain and stop `name`; returns once its workers have exited."""
        self._request(
            "POST",
            f"/v2/repository/models/{segment(name)}/unload",
            patient=True,
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
        limit = self.max_answer_mb << 20
        response = self._request("POST", path, limit, content=body, headers=headers)
        try:
            return decode_infer_response(
                response.content, response.headers.get("inference-header-content-length")
            )
        except ValueError as exc:
            raise ClientError(
                response.status,
                self._odd("POST", path, f"something that is not a V2 inference response ({exc})"),
            ) from None
