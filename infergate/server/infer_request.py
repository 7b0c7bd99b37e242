"""What an infer request says outside its tensors: the version in its path, the caller's
key and text headers, and its parameters (timeout, priority, session, sequence), read and
checked (400 naming what is wrong); and the engine's request made from them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from infergate.engine.inference import InferenceRequest
from infergate.engine.scheduling.sequences import sequence_params
from infergate.engine.triton.classification import check_classifications
from infergate.engine.triton.shared_memory import SYSTEM_SHM, wants_shared_memory
from infergate.errors import BadRequest, Unauthorized, shown
from infergate.server.codec import DecodedRequest

_VERSION = re.compile(r"[0-9]{1,18}")  # (ASCII digits: str.isdigit takes "²", int() not)


def version_number(version: str | None) -> int | None:
    if version is None or version == "":
        return None
    if _VERSION.fullmatch(version) is None or int(version) <= 0:
        raise BadRequest(f"model version must be a positive integer, got {shown(version)}")
    return int(version)


def timeout_s(parameters: dict[str, Any]) -> float | None:
    """tritonclient sends `timeout` in microseconds."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise BadRequest(
            f"parameters.timeout must be a positive number of microseconds, got {shown(timeout)}"
        )
    return float(timeout) / 1e6


def session_of(parameters: dict[str, Any]) -> str | None:
    session = parameters.get("session")
    if session is None:
        return None
    if not isinstance(session, (str, int)) or isinstance(session, bool):
        raise BadRequest(f"parameters.session must be a string, got {shown(session)}")
    return str(session)


HEADER_LENGTH = b"inference-header-content-length"


def header_text(headers: dict[bytes, bytes], name: bytes) -> str | None:
    """A header that must be ASCII text; 400 naming it when it is not."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(
            f"header {name.decode()} holds bytes that are not ASCII: {raw[:40]!r}"
        ) from None


_KEY_HEADERS = (b"authorization", b"x-api-key")


def api_key(
    headers: dict[bytes, bytes], raw: Sequence[tuple[bytes, bytes]] | None = None
) -> str | None:
    """The caller's key from `Authorization: Bearer <key>` or `X-API-Key: <key>`: 401 for
    a Bearer with no key (a client that meant to send one, not an anonymous one), 400 for
    two different keys (which one the request runs as would be the gateway's guess).
    `raw`: the headers as they came, `headers` made of them: one of the two sent twice
    with different values is two keys too (the dict kept the last: a client's header
    after a proxy's ran as the client's key)."""
    if raw is not None and len(raw) != len(headers):  # a header came twice: which?
        _one_of_each(raw)
    key = headers.get(b"x-api-key")
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, token = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer":
            token = token.strip()
            if not token:
                raise Unauthorized(
                    "Authorization: Bearer names no key. Hint: send the key after it, or "
                    "no Authorization header for anonymous access"
                )
            if key and key.strip() and key.decode("latin-1").strip() != token:
                raise BadRequest(
                    "the request names two different keys (Authorization: Bearer and "
                    "X-API-Key); send one"
                )
            return token
    return key.decode("latin-1").strip() if key else None


def _one_of_each(raw: Sequence[tuple[bytes, bytes]]) -> None:
    seen: dict[bytes, bytes] = {}
    for name, value in raw:
        if name in _KEY_HEADERS and seen.setdefault(name, value) != value:
            raise BadRequest(
                f"the request sends {name.decode()} twice, with different values; send one key"
            )


def inference_request(name: str, number: int | None, decoded: DecodedRequest) -> InferenceRequest:
    if decoded.output_parameters:  # (rare) refused before the model runs, not after it
        check_output_parameters(decoded.output_parameters)
    params = decoded.parameters
    if not params:  # most requests: no timeout, priority, session or sequence to read
        return InferenceRequest(name, decoded.inputs, number, decoded.outputs)
    return InferenceRequest(
        model=name,
        version=number,
        inputs=decoded.inputs,
        outputs=decoded.outputs,
        timeout_s=timeout_s(params),
        priority=params.get("priority"),
        session=session_of(params),
        sequence=sequence_params(params),
    )


def check_output_parameters(parameters: dict[str, dict[str, Any]]) -> None:
    """400 for an output's parameters the answer could not honour (a classification's
    count, a shared memory range), before the request is queued: found after the model
    ran, such a request cost a run, and counted in the statistics as a success."""
    check_classifications(parameters)
    for name, params in parameters.items():
        if wants_shared_memory(params):
            SYSTEM_SHM.check_output(name, params)
