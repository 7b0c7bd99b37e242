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


class _Paused(asyncio.Transport):
    """A transport with no socket whose reading can be paused (the gate does)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def test_an_idle_connection_is_not_closed_while_the_gate_holds_its_reading() -> None:
    """What its client sent may be waiting unread in its socket: closing it as idle
    would lose that request."""
    from infergate.server.http_protocol import ConnectionLimits
    from tests.fake_connection import serve_on

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("no request is read")

    loop = asyncio.get_running_loop()
    gate = ReadGate()
    transport = _Paused()
    protocol = serve_on(transport, app, ConnectionLimits(keep_alive_timeout_s=0.1), None, gate)
    gate.connections = [protocol]
    gate.hold()
    assert not transport.reading
    try:
        began = loop.time()
        while loop.time() < began + 0.5:  # five keep-alive timeouts, by the loop's clock
            await asyncio.sleep(0.05)
            assert not transport.closed
        gate.release()
        assert transport.reading
        while not transport.closed:  # idle once more, now its own: closed
            await asyncio.sleep(0.05)
            assert loop.time() < began + 10, "never closed once the gate opened"
    finally:
        protocol.connection_lost(None)
