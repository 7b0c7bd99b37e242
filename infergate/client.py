"""One typed HTTP client for infergate (and any KServe V2 server), used by the CLI,
the dashboard and bench. Tensors go as binary data by default."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

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
    """The server answered with an error, or could not be reached (status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class InferResponse:
    model: str
    version: str
    id: str | None
    outputs: dict[str, Array]
    raw: dict[str, Any]


def normalize_url(text: str) -> str:
    """`localhost:8000` and `http://localhost:8000/` both mean http://localhost:8000."""
    text = text.strip().rstrip("/")
    return text if "://" in text else f"http://{text}"


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
        return normalize_url(env)
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
    import numpy as np

    from infergate.tensors import from_wire, numpy_dtype

    json_len = int(header_length) if header_length is not None else len(body)
    doc = orjson.loads(body[:json_len])
    offset = json_len
    outputs: dict[str, Array] = {}
    for out in doc.get("outputs", []):
        shape = tuple(out["shape"])
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outputs[out["name"]] = from_wire(body[offset : offset + size], out["datatype"], shape)
            offset += size
        elif out["datatype"] == "BYTES":
            flat = np.array(
                [s.encode() if isinstance(s, str) else s for s in out["data"]], dtype=object
            )
            outputs[out["name"]] = flat.reshape(shape)
        else:
            dtype = numpy_dtype(out["datatype"])
            outputs[out["name"]] = np.array(out["data"], dtype=dtype).reshape(shape)
    return InferResponse(
        doc.get("model_name", ""), str(doc.get("model_version", "")), doc.get("id"), outputs, doc
    )


class Client:
    def __init__(
        self, url: str | None = None, token: str | None = None, timeout_s: float = 30.0
    ) -> None:
        headers = {}
        if token:  # the caller picks the token: a tenant's key or an admin key
            headers["Authorization"] = f"Bearer {token}"
        self.url = normalize_url(url) if url else default_url()
        self.auth_headers = headers
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
        except httpx.HTTPError as exc:
            unread = project_profile_unread() if self.url == DEFAULT_URL else None
            raise ClientError(
                0,
                f"cannot reach infergate at {self.url}: {exc}. Hint: is "
                "`infergate serve` running? Set --url or INFERGATE_URL"
                + (f" ({unread})" if unread else ""),
            ) from None
        if response.status_code >= 400:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text or response.reason_phrase
            raise ClientError(response.status_code, message)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return orjson.loads(self._request(method, path, **kwargs).content)

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
        return self._json("GET", "/v2")  # type: ignore[no-any-return]

    def models(self) -> list[dict[str, Any]]:
        return self._json("GET", "/admin/models")  # type: ignore[no-any-return]

    def model(self, name: str) -> dict[str, Any]:
        return self._json("GET", f"/admin/models/{quote(name, safe='')}")  # type: ignore[no-any-return]

    def metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        path = f"/v2/models/{quote(name, safe='')}" + (f"/versions/{version}" if version else "")
        return self._json("GET", path)  # type: ignore[no-any-return]

    def repository_index(self) -> list[dict[str, Any]]:
        return self._json("POST", "/v2/repository/index")  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return self._json("GET", "/admin/stats")  # type: ignore[no-any-return]

    def tenants(self) -> dict[str, Any]:
        return self._json("GET", "/admin/tenants")  # type: ignore[no-any-return]

    def add_tenant(self, name: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self._json(  # type: ignore[no-any-return]
            "POST", "/admin/tenants", content=orjson.dumps({"name": name, **settings})
        )

    def set_tenant(self, name: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self._json(  # type: ignore[no-any-return]
            "PATCH", f"/admin/tenants/{quote(name, safe='')}", content=orjson.dumps(settings)
        )

    def remove_tenant(self, name: str) -> None:
        self._request("DELETE", f"/admin/tenants/{quote(name, safe='')}")

    def breakers(self) -> list[dict[str, Any]]:
        return self._json("GET", "/admin/breakers")  # type: ignore[no-any-return]

    def set_breaker(self, model: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self._json(  # type: ignore[no-any-return]
            "PATCH", f"/admin/breakers/{quote(model, safe='')}", content=orjson.dumps(settings)
        )

    def reset_breaker(self, model: str) -> None:
        self._request("POST", f"/admin/breakers/{quote(model, safe='')}/reset")

    def load_model(self, name: str) -> None:
        """Load or reload `name` from disk; returns once it serves (or raises why not)."""
        self._request("POST", f"/v2/repository/models/{quote(name, safe='')}/load", timeout=None)

    def unload_model(self, name: str) -> None:
        """Drain and stop `name`; returns once its workers have exited."""
        self._request("POST", f"/v2/repository/models/{quote(name, safe='')}/unload", timeout=None)

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
        path = (
            f"/v2/models/{quote(model, safe='')}"
            + (f"/versions/{version}" if version else "")
            + "/infer"
        )
        response = self._request("POST", path, content=body, headers=headers)
        return decode_infer_response(
            response.content, response.headers.get("inference-header-content-length")
        )
