"""A front's reading held while its link to the engine is backed up (`[server] fronts`).

In one process, a request's body waits in its client's socket until the engine's loop
reads it, so a flood of large bodies is held by the kernel and the clients' own sends. A
front reads bodies faster than one engine takes them (two fronts: about 0.7 GB/s of 1 MB
bodies here), and what the engine has not taken yet waited in the front's link buffer:
2,000 bodies of 1 MB from a client that closed each socket at once took a front to 981 MB
and its engine to 1 GB. So while the link's write buffer is above its high-water mark
(`pause_writing`), every client connection of the front stops reading (its transport's
`pause_reading`), new ones too, until the engine has read the backlog (`resume_writing`):
the bodies wait in the clients' sockets again, as in one process.

uvicorn pauses a connection's reading for reasons of its own (a pipelined request waiting
for the one before it); `GatedFlowControl` keeps the two apart, so that neither resumes
what the other holds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl


class ReadGate:
    """Whether a front's client connections may read; `connections`: the live ones (the
    uvicorn server's set, given once it exists)."""

    def __init__(self) -> None:
        self.held = False
        # uvicorn's protocols (a `transport` and a `flow` each), of every kind it serves
        self.connections: Iterable[Any] = ()
        self.holds = 0  # how many times the link was backed up (tests read it)

    def hold(self) -> None:
        if self.held:
            return
        self.held = True
        self.holds += 1
        for connection in list(self.connections):
            transport = connection.transport
            if transport is not None and not transport.is_closing():
                transport.pause_reading()

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        for connection in list(self.connections):
            transport = connection.transport
            flow = connection.flow
            if (
                transport is not None
                and not transport.is_closing()
                and not (flow is not None and flow.read_paused)  # uvicorn holds it itself
            ):
                transport.resume_reading()


class GatedFlowControl(FlowControl):
    """uvicorn's flow control, whose `resume_reading` leaves a held gate's connection
    paused (the gate resumes it when released)."""

    def __init__(self, transport: asyncio.Transport, gate: ReadGate) -> None:
        super().__init__(transport)
        self._gate = gate

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            if not self._gate.held:
                self._transport.resume_reading()
