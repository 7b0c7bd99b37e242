"""The link between a front and the engine (server/link.py, server/front_link.py): a message
marshal cannot carry (bytes of 2 GiB or more) costs only its own request, never the
others sent in the same event-loop step, and a forwarded answer's body goes in pieces
small enough to carry. Both ends are real LinkProtocols over a real Unix socket."""

from __future__ import annotations

import asyncio
import marshal
from collections.abc import Callable
from pathlib import Path

import pytest

from infergate.server.front_link import in_place_of, pieces
from infergate.server.link import LinkProtocol, Message


async def test_a_message_the_link_cannot_carry_costs_only_its_own_request(
    tmp_path: Path,
) -> None:
    got: list[Message] = []
    arrived = asyncio.Event()

    def received(message: Message) -> None:
        got.append(message)
        if message[0] == "last":
            arrived.set()

    front = LinkProtocol(received)
    engine = LinkProtocol(lambda _: None, instead=in_place_of)
    path = str(tmp_path / "link.sock")
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: front, path)
    await loop.create_unix_connection(lambda: engine, path)
    # (object() stands for a 2 GiB body: marshal refuses both with ValueError)
    unmarshallable = object()
    with pytest.raises(ValueError, match="unmarshallable"):
        marshal.dumps(unmarshallable)  # type: ignore[arg-type]  # what it checks
    try:
        engine.send(("reply", 1, 200, [], b"{}", "a"))  # all in one step
        engine.send(("reply", 2, 200, [], unmarshallable, "b"))
        engine.send(("result", 3, "c", ("m", 1, [("y", "FP32", (1,), unmarshallable)])))
        engine.send(("chunk", 4, unmarshallable, True))
        engine.send(("start", 5, 200, unmarshallable))
        engine.send(("http", 6, unmarshallable))  # nothing to send in its place
        engine.send(("last", 7))
        await asyncio.wait_for(arrived.wait(), 10)
        assert [m[:3] for m in got] == [
            ("reply", 1, 200),
            ("reply", 2, 500),  # answered, as the tenant's own
            ("reply", 3, 500),
            ("abort", 4),
            ("abort", 5),
            ("last", 7),
        ]
        assert (got[1][5], got[2][5]) == ("b", "c")
        assert b"too large to pass from the engine to its front" in got[1][4]
        engine.send(("reply", 8, 200, [], b"{}", "a"))  # the link carries on
        await asyncio.wait_for(_until(lambda: got[-1][1] == 8), 10)
    finally:
        await _close(server, front, engine)


async def _close(server: asyncio.Server, *ends: LinkProtocol) -> None:
    for end in ends:
        if end.transport is not None:
            end.transport.close()
    server.close()
    await server.wait_closed()


async def _until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("size", "more"), [(0, False), (0, True), (5, False), (10, True)])
def test_a_forwarded_answer_goes_in_pieces_that_say_what_follows(size: int, more: bool) -> None:
    body = bytes(range(size))
    got = list(pieces(body, more, size=4))
    assert b"".join(p for p, _ in got) == body
    assert all(len(p) <= 4 for p, _ in got)
    assert [f for _, f in got] == [True] * (len(got) - 1) + [more]


class _Frames(LinkProtocol):
    """A receiving end that counts the frames its messages came in."""

    def __init__(self) -> None:
        super().__init__(self._got)
        self.frames: list[int] = []
        self.messages: list[Message] = []

    def _deliver(self, frame: list[Message]) -> None:
        self.frames.append(len(frame))
        super()._deliver(frame)

    def _got(self, message: Message) -> None:
        self.messages.append(message)


async def _pair(tmp_path: Path, receiver: LinkProtocol, sender: LinkProtocol) -> asyncio.Server:
    path = str(tmp_path / "link.sock")
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: receiver, path)
    await loop.create_unix_connection(lambda: sender, path)
    await _until(lambda: receiver.transport is not None)
    return server


async def test_bodies_sent_in_one_step_go_in_frames_of_about_a_megabyte(tmp_path: Path) -> None:
    """The peer holds a frame whole before it reads any of it: a front's step that read
    many large bodies went as one frame of hundreds of megabytes."""
    engine, front = _Frames(), LinkProtocol(lambda _: None)
    server = await _pair(tmp_path, engine, front)
    try:
        body = b"x" * 600_000
        for rid in range(5):  # one step: 1.2 MB queued after the second, and the fourth
            front.send(("body", rid, body, False), len(body))
        front.send(("cancel", 9))  # no body: joins the last frame
        await _until(lambda: len(engine.messages) == 6)
        assert engine.frames == [2, 2, 2]
        assert [m[1] for m in engine.messages] == [0, 1, 2, 3, 4, 9]
    finally:
        await _close(server, engine, front)


async def test_a_sender_is_told_when_its_peer_falls_behind_and_when_it_catches_up(
    tmp_path: Path,
) -> None:
    told: list[bool] = []
    engine, front = _Frames(), LinkProtocol(lambda _: None, on_writable=told.append)
    server = await _pair(tmp_path, engine, front)
    try:
        assert engine.transport is not None
        engine.transport.pause_reading()  # an engine busy elsewhere
        body = b"x" * (1 << 20)
        rid = 0
        while not told:  # the socket's buffers fill, then the sender's past 4 MB
            front.send(("body", rid, body, False), len(body))
            rid += 1
            await asyncio.sleep(0)
        assert told == [False]
        assert rid > 4
        engine.transport.resume_reading()
        await _until(lambda: told == [False, True])
        await _until(lambda: len(engine.messages) == rid)
    finally:
        await _close(server, engine, front)
