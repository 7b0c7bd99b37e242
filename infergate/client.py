"""One typed HTTP client for infergate (and any KServe V2 server), used by the CLI,
the dashboard and bench. Tensors go as binary data by default."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import httpx
import orjson

if TYPE_CHECKING:
    from infergate.tensors import Array

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    """The server answered with an error, or could not be reached (status 0), or answered
    with something that is not what an infergate server sends (the status it came with)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UrlError(ValueError):
    """A server address that is not one (`--url`, INFERGATE_URL): a usage mistake."""


MAX_ERROR_CHARS = 300  # of a body's text: one line, not a whole HTML page
MAX_SERVER_ERROR_CHARS = 2000  # of a JSON `error`: infergate's own can list many inputs


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line (its whitespace runs as single spaces), at most `limit`
    characters: an error from a server goes on one line of stderr or a status line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


_HTML_TITLE = re.compile(rb"<(title|h1)[^>]*>(.*?)</\1\s*>", re.IGNORECASE | re.DOTALL)


def error_text(body: bytes, reason: str = "") -> str:
    """What a server said in an error's body, on one line: infergate's `{"error": "..."}`,
    another JSON document as compact JSON, an HTML page (a proxy's, a wrong server's) by
    its title, other text as written (invalid UTF-8 replaced); the reason phrase when the
    body is empty."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        if body.lstrip()[:1] == b"<":
            found = _HTML_TITLE.search(body)
            if found is not None and found.group(2).strip():
                body = b"an HTML page: " + re.sub(rb"<[^>]*>", b"", found.group(2))
    else:
        if isinstance(doc, dict) and doc.get("error") is not None:
            doc = doc["error"]
        if not isinstance(doc, str):
            return one_line(orjson.dumps(doc).decode())
        return one_line(doc, MAX_SERVER_ERROR_CHARS) or reason
    return one_line(body.decode("utf-8", "replace")) or reason


@dataclass(frozen=True)
class InferResponse:
    model: str
    version: str
    id: str | None
    outputs: dict[str, Array]
    raw: dict[str, Any]


def normalize_url(text: str, what: str = "--url") -> str:
    """`localhost:8000` and `http://localhost:8000/` both mean http://localhost:8000.
    UrlError (naming `what`) for an address that is not an http(s) URL of a host and port."""
    given = text
    text = text.strip()
    url = (text if "://" in text else f"http://{text}").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UrlError(f"{what} {given!r}: not an http:// or https:// address")
    if any(c.isspace() for c in url):
        raise UrlError(f"{what} {given!r}: an address holds no spaces")
    if not parts.hostname:
        raise UrlError(f"{what} {given!r}: no host in it (like localhost:8000)")
    try:
        parts.port  # noqa: B018  (reading it checks it)
    except ValueError:
        raise UrlError(f"{what} {given!r}: the port is not a number from 0 to 65535") from None
    if parts.query or parts.fragment:
        raise UrlError(f"{what} {given!r}: a server address has no ?query or #fragment")
    return url


PROJECT_PROFILE = Path("profiles") / "default.toml"


def project_port(folder: Path | None = None) -> int | None:
    """The port of profiles/default.toml in `folder` (the working directory), if any: run
    in a project folder, the CLI finds the server that `infergate serve` started there."""
    path = (folder or Path.cwd()) / PROJECT_PROFILE
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return None
    port = doc.get("server", {}).get("port") if isinstance(doc.get("server"), dict) else None
    return port if isinstance(port, int) and 0 < port < 65536 else None


def project_profile_unread(folder: Path | None = None) -> str | None:
    """Why ./profiles/default.toml, present, gave no port (a broken edit): the server that
    started from it may listen elsewhere than the URL tried. None when it did, or is absent."""
    path = (folder or Path.cwd()) / PROJECT_PROFILE
    if os.environ.get("INFERGATE_URL", "").strip() or not path.is_file():
        return None
    try:
        tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{PROJECT_PROFILE} does not parse ({exc}), so its port was not used"
    return None


def default_url() -> str:
    """$INFERGATE_URL (with or without a scheme), else the port of ./profiles/default.toml,
    else http://127.0.0.1:8000."""
    env = os.environ.get("INFERGATE_URL", "").strip()
    if env:
        return normalize_url(env, "INFERGATE_URL")
    port = project_port()
    return f"http://127.0.0.1:{port}" if port is not None else DEFAULT_URL


def encode_infer_request(
    inputs: dict[str, Array],
    outputs: list[str] | None = None,
    binary: bool = True,
    request_id: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """A V2 request body and its headers, binary tensors after the JSON header."""
    # (numpy, 60 ms and more, only for the commands that send or read tensors)
    from infergate.tensors import to_wire, v2_datatype

    tensors = []
    blobs = []
    for name, array in inputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": v2_datatype(array.dtype),
            "shape": list(array.shape),
        }
        if binary:
            blob = to_wire(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            flat = array.reshape(-1)
            entry["data"] = (
                [x.decode() if isinstance(x, bytes) else x for x in flat]
                if array.dtype.kind == "O"
                else flat.tolist()
            )
        tensors.append(entry)
    doc: dict[str, Any] = {"inputs": tensors, "parameters": dict(parameters or {})}
    if binary:
        doc["parameters"]["binary_data_output"] = True
    if outputs:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    if request_id is not None:
        doc["id"] = request_id
    header = orjson.dumps(doc)
    if not blobs:
        return header, {"Content-Type": "application/json"}
    return b"".join([header, *blobs]), {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


def decode_infer_response(body: bytes, header_length: str | None) -> InferResponse:
    """A V2 inference response (JSON, binary tensors after it); ValueError saying what is
    wrong with one that is not."""
    try:
        return _decode_infer_response(body, header_length)
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def _decode_infer_response(body: bytes, header_length: str | None) -> InferResponse:
    import numpy as np

    from infergate.tensors import from_wire, numpy_dtype

    if header_length is None:
        json_len = len(body)
    else:
        json_len = int(header_length) if header_length.strip().isdigit() else -1
        if not 0 <= json_len <= len(body):
            raise ValueError(
                f"Inference-Header-Content-Length {header_length!r} does not fit a body of "
                f"{len(body)} bytes"
            )
    doc = orjson.loads(body[:json_len])
    if not isinstance(doc, dict):
        raise ValueError(f"the JSON is {_kind(doc)}, not an object")
    offset = json_len
    outputs: dict[str, Array] = {}
    for out in doc.get("outputs") or []:
        name, datatype, shape = out["name"], out["datatype"], tuple(out["shape"])
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise ValueError(f"an output's name and datatype are not strings: {out}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"output {name!r} has the shape {list(shape)}")
        if name in outputs:
            raise ValueError(f"output {name!r} comes twice")
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(body):
                raise ValueError(f"output {name!r}: binary_data_size {size} runs past the body")
            outputs[name] = from_wire(body[offset : offset + size], datatype, shape)
            offset += size
        elif datatype == "BYTES":
            flat = np.array(
                [s.encode() if isinstance(s, str) else s for s in out["data"]], dtype=object
            )
            outputs[name] = flat.reshape(shape)
        else:
            dtype = numpy_dtype(datatype)
            outputs[name] = np.array(out["data"], dtype=dtype).reshape(shape)
    return InferResponse(
        _text(doc.get("model_name")),
        _text(doc.get("model_version")),
        doc.get("id"),
        outputs,
        doc,
    )


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _kind(value: Any) -> str:
    """A JSON value's kind, for saying what came instead of what was expected."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a string" if isinstance(value, str) else "a number"


def check_token(token: str) -> None:
    """UrlError for a token an HTTP header cannot carry (httpx would fail on it later)."""
    if not token.isascii() or not token.isprintable():
        raise UrlError(
            "the token holds characters an HTTP header cannot carry (non-ASCII, or control "
            "characters such as a newline); check --token or its environment variable"
        )


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
                self._odd(method, path, f"{_kind(doc)} where infergate sends {wanted}"),
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
            got = _kind(doc) if not isinstance(doc, list) else "an array of other things"
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
        return self._json("GET", f"/admin/models/{quote(name, safe='')}", dict)  # type: ignore[no-any-return]

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
            f"/admin/tenants/{quote(name, safe='')}",
            dict,
            content=orjson.dumps(settings),
        )

    def remove_tenant(self, name: str) -> None:
        self._request("DELETE", f"/admin/tenants/{quote(name, safe='')}")

    def breakers(self) -> list[dict[str, Any]]:
        path = "/admin/breakers"
        return self._records("GET", path, self._json("GET", path, list))

    def set_breaker(self, model: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self._json(  # type: ignore[no-any-return]
            "PATCH",
            f"/admin/breakers/{quote(model, safe='')}",
            dict,
            content=orjson.dumps(settings),
        )

    def reset_breaker(self, model: str) -> None:
        self._request("POST", f"/admin/breakers/{quote(model, safe='')}/reset")

    def _no_read_timeout(self) -> httpx.Timeout:
        """For a call that waits as long as the server works (a load): no limit on the
        answer, but one on connecting, so that an address nothing answers at still fails."""
        return httpx.Timeout(None, connect=self.timeout_s)

    def load_model(self, name: str) -> None:
        """Load or reload `name` from disk; returns once it serves (or raises why not)."""
        self._request(
            "POST",
            f"/v2/repository/models/{quote(name, safe='')}/load",
            timeout=self._no_read_timeout(),
        )

    def unload_model(self, name: str) -> None:
        """Drain and stop `name`; returns once its workers have exited."""
        self._request(
            "POST",
            f"/v2/repository/models/{quote(name, safe='')}/unload",
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


def model_path(model: str, version: str | None) -> str:
    """/v2/models/NAME[/versions/V], each part escaped (a version `../x` stays a version)."""
    path = f"/v2/models/{quote(model, safe='')}"
    return path + (f"/versions/{quote(version, safe='')}" if version else "")
