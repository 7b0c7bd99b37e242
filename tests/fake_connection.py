"""The gateway's HTTP protocol on a fake transport, in the running event loop: what a test
writes to `data_received` is what a client sent, and the transport keeps what is answered."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from infergate.server.http_protocol import ConnectionLimits, GatewayHttpProtocol
from infergate.server.infer_lane import InferLane
from infergate.server.read_gate import ReadGate


def serve_on(
    transport: Any,
    app: Any,
    limits: ConnectionLimits = GatewayHttpProtocol.limits,
    lane: InferLane | None = None,
    read_gate: ReadGate | None = None,
) -> GatewayHttpProtocol:
    """A protocol serving `app` (and `lane`) on `transport`, its connection made."""
    protocol_class = GatewayHttpProtocol.with_limits(limits, lane, read_gate)
    config = uvicorn.Config(app, http=protocol_class, log_config=None)
    config.load()
    protocol = protocol_class(config, ServerState(), {}, asyncio.get_running_loop())
    protocol.connection_made(transport)
    return protocol
