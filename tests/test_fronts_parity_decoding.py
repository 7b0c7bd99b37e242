"""`[server] fronts`: what a front decodes for the engine (server/predecode.py,
server/front.py) is only what the engine would decode, so a front costs no decoding that
one process does not: a request the engine refuses first (an unknown model, a model the
key may not use, a tenant told to come back later) goes undecoded, and a BYTES tensor,
which the engine decodes itself, is not decoded first in the front. The engine's end of
the link is played here, in this process: no gateway is started."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infergate.server.front import EngineLink, ForwardRoute
from infergate.server.link import LinkProtocol, Message
from infergate.server.predecode import pack
from infergate.server.reply import Reply
from tests.fronts_parity import GOOD, KEY, json_body


class _Engine:
    """The engine's end of a front's link, played: each request's answer as the test says,
    and whether the front sent it decoded."""

    def __init__(self) -> None:
        self.decoded: list[bool] = []
        self.answers: list[tuple[int, list[tuple[bytes, bytes]]]] = []
        self.end = LinkProtocol(self._on_message)

    def _on_message(self, message: Message) -> None:
        self.decoded.append(message[-1] is not None)
        status, headers = self.answers.pop(0)
        tenant = "-" if status == 401 else "t"
        self.end.send(("reply", message[1], status, headers, b"{}", tenant))


async def _front_and_engine(
    tmp_path: Path,
) -> tuple[ForwardRoute, _Engine, Callable[[], Any]]:
    engine = _Engine()
    path = str(tmp_path / "link.sock")
    server = await asyncio.get_running_loop().create_unix_server(lambda: engine.end, path)
    link = EngineLink()
    await link.connect(path, lambda: None)

    async def close() -> None:
        for end in (link.link, engine.end):
            if end is not None and end.transport is not None:
                end.transport.close()
        server.close()
        await server.wait_closed()

    return ForwardRoute(link, 64 * 1024), engine, close


async def _ask(
    route: ForwardRoute,
    engine: _Engine,
    model: str,
    status: int,
    headers: list[tuple[bytes, bytes]] | None = None,
    key: str = KEY,
    body: bytes = GOOD,
) -> bool:
    """Whether the front sent this request decoded; the engine answers `status`."""
    engine.answers.append((status, headers or []))
    replied: asyncio.Future[Reply | None] = asyncio.get_running_loop().create_future()
    route.answer_now(model, None, [(b"x-api-key", key.encode())], body, replied.set_result)
    reply = await replied
    assert reply is not None
    assert reply.status == status
    return engine.decoded[-1]


async def test_a_front_does_not_decode_for_a_model_the_engine_refuses(tmp_path: Path) -> None:
    """A key served on one model, asking for one that does not exist (404) or that it
    may not use (403): one process refuses it before decoding its body, and the front
    must not decode it either (it did: a 64 KiB body cost the front 2-3 ms a request,
    ten times and more what the refusal costs one process, in other tenants' time)."""
    route, engine, close = await _front_and_engine(tmp_path)
    try:
        assert not await _ask(route, engine, "m", 200), "the key's first request"
        assert await _ask(route, engine, "m", 200), "served on m before: decoded"
        assert not await _ask(route, engine, "nope", 404), "never served on nope"
        assert not await _ask(route, engine, "nope", 404), "refused there"
        assert not await _ask(route, engine, "private", 403)
        assert await _ask(route, engine, "m", 200), "m still decoded"
        assert await _ask(route, engine, "m", 403), "m served before"
        assert not await _ask(route, engine, "m", 200), "refused on m since"
        assert await _ask(route, engine, "m", 200), "served on m again"
    finally:
        await close()


async def test_a_front_does_not_decode_for_a_tenant_told_to_come_back_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant over its rate or concurrency (429, Retry-After: N): one process refuses
    its requests before decoding them, and until then the front does not decode them
    (it did, each: a throttled tenant's flood cost fronts ten times its cost to one
    process). After its Retry-After, the front decodes for it again."""
    import infergate.server.front as front

    now = [1000.0]

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(front, "time", Clock)
    route, engine, close = await _front_and_engine(tmp_path)
    later = [(b"content-type", b"application/json"), (b"retry-after", b"3")]
    try:
        assert not await _ask(route, engine, "m", 200)
        assert await _ask(route, engine, "m", 429, later), "served on m before: decoded"
        assert not await _ask(route, engine, "m", 429, later), "told to come back in 3 s"
        now[0] += 2.5
        assert not await _ask(route, engine, "m", 200), "not yet"
        now[0] += 0.6
        assert await _ask(route, engine, "m", 200), "3 s on"
        assert not await _ask(route, engine, "m", 200, key="other"), "another key's own"
    finally:
        await close()


def test_a_front_does_not_decode_strings_only_to_send_them_as_a_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A BYTES tensor goes to the engine as its body (it decodes it): the front did
    decode it first all the same, a wasted decoding (1.8 ms of a front's time for 64 KiB
    of strings, besides the engine's own)."""
    import infergate.server.predecode as predecode
    from infergate.server.codec import decode_request

    decoded: list[bytes] = []

    def counted(body: Any, header_length: str | None) -> Any:
        decoded.append(bytes(body))
        return decode_request(body, header_length)

    monkeypatch.setattr(predecode, "decode_request", counted)
    strings = json_body(
        {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]}
    )
    assert pack(strings, {}, 1 << 20) is None
    assert decoded == []
    assert pack(GOOD, {}, 1 << 20) is not None  # numbers still are
    escaped = strings.replace(b'"BYTES"', b'"BYTE\\u0053"')  # (found by decoding: still refused)
    assert pack(escaped, {}, 1 << 20) is None
    assert decoded == [GOOD, escaped]
