"""The infer route's pass-through for remote models: with the JSON header read (for its
parameters: BodyDecoder.pass_through_header), the body goes on unchanged. A request that
needs decoding here (its tensors are in this machine's shared memory) goes the usual way
instead, and is re-encoded upstream."""

from __future__ import annotations

from typing import Any

from infergate.engine.admission.tenants import TenantState
from infergate.engine.engine import Engine
from infergate.engine.remote.client import answered
from infergate.engine.remote.passthrough import forward_admitted
from infergate.engine.remote.served import RemoteServedVersion
from infergate.server.codec import Body


async def pass_through(
    engine: Engine,
    served: RemoteServedVersion,
    body: Body,
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
    # The body as it came (a large one: a view of its mapping, never copied on the loop).
    reply = await forward_admitted(
        engine.context, served, body, headers, priority, timeout_s, tenant
    )
    if reply.status != 200:
        raise answered(reply)
    return reply.headers, reply.body
