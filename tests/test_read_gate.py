"""A front's read gate (server/read_gate.py): while the link to the engine is backed up,
every client connection of the front stops reading, and a connection uvicorn paused for
its own reasons (a pipelined request) is left to uvicorn when the gate opens, and the
other way round. Real connections over loopback; `is_reading` is the transport's own."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from infergate.server.read_gate import GatedFlowControl, ReadGate


@dataclass
class _Connection:  # what the gate sees of uvicorn's protocol: its transport and flow
    transport: asyncio.Transport
    flow: GatedFlowControl


async def _connections(gate: ReadGate, count: int) -> tuple[list[_Connection], asyncio.Server]:
    transports: list[asyncio.Transport] = []

    class Accepted(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transports.append(transport)  # type: ignore[arg-type]

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Accepted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    for _ in range(count):
        await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    while len(transports) < count:
        await asyncio.sleep(0.01)
    return [_Connection(t, GatedFlowControl(t, gate)) for t in transports], server


async def test_the_gate_holds_every_connection_and_opens_only_what_it_held() -> None:
    gate = ReadGate()
    connections, server = await _connections(gate, 2)
    gate.connections = connections
    free, pipelined = connections
    try:
        gate.hold()
        assert not free.transport.is_reading()
        assert not pipelined.transport.is_reading()
        pipelined.flow.pause_reading()  # uvicorn's own pause, while the gate holds
        gate.release()
        assert free.transport.is_reading()
        assert not pipelined.transport.is_reading()  # still uvicorn's to resume

        gate.hold()
        pipelined.flow.resume_reading()  # uvicorn is done with it: the gate still holds
        assert not pipelined.transport.is_reading()
        gate.release()
        assert pipelined.transport.is_reading()
        assert free.transport.is_reading()
        assert gate.holds == 2
    finally:
        for connection in connections:
            connection.transport.close()
        server.close()
        await server.wait_closed()
