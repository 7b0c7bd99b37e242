"""The infer route's pass-through for remote models: parse the JSON header only, and
send the body on unchanged. A request that needs decoding here (its tensors are in this
machine's shared memory) goes the usual way instead, and is re-encoded upstream."""

from __future__ import annotations

from typing import Any

from infergate.engine.admission.tenants import TenantState
from infergate.engine.engine import Engine
from infergate.engine.remote.client import answered
from infergate.engine.remote.passthrough import forward_admitted
from infergate.engine.remote.served import RemoteServedVersion
from infergate.server.codec import Body, _header_length, json_object

# Shared-memory regions are this machine's: the upstream cannot read them.
_LOCAL_ONLY = b"shared_memory_region"


def header_of(body: Body, header_length: str | None) -> dict[str, Any] | None:
    """The request's JSON header, or None when the request must be decoded here."""
    json_len = len(body) if header_length is None else _header_length(header_length, len(body))
    header = body[:json_len]
    if isinstance(header, memoryview):  # (a large body: `in` would look for an int)
        header = header.tobytes()
    if _LOCAL_ONLY in header:
        return None
    return json_object(header, "a JSON object with an 'inputs' array")


async def pass_through(
    engine: Engine,
    served: RemoteServedVersion,
    body: Body,
    doc: dict[str, Any],
    header_length: str | None,
    content_type: str | None,
    priority: Any,
    timeout_s: float | None,
    tenant: TenantState,
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The upstream's 200 answer (its body and body headers, unchanged); an error answer
    raises, keeping its status, message and Retry-After."""
    headers = {"content-type": content_type or "application/json"}
    if header_length is not None:
        headers["inference-header-content-length"] = header_length
    if not isinstance(body, bytes):  # httpx would iterate a bytearray or a view as ints
        body = bytes(body)
    reply = await forward_admitted(
        engine.context, served, body, headers, priority, timeout_s, tenant
    )
    if reply.status != 200:
        raise answered(reply)
    return reply.headers, reply.body
