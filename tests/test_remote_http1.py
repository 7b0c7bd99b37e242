"""The remote client's transport (engine/remote/http1.py, slots.py and the pool's control
calls): keep-alive connections and their slots, answers read within their limits, and
health checks bounded whole, against upstreams on loopback that misbehave on purpose.
tests/test_remote_rules.py holds the remote runtime's rules above it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from infergate.clock import FakeClock
from infergate.engine.remote.client import RemotePool
from infergate.engine.remote.config import RemoteConfig
from infergate.engine.remote.http1 import Http1Pool, Reply, read_reply
from infergate.engine.remote.slots import FairSlots
from infergate.errors import BrokenReply, ConnectFailed, PoolTimeout
from tests.polling import eventually
from tests.remote_upstream import Upstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """`handler` serving each connection on a loopback port: its base URL. Every
    connection is closed at the end (a server's close leaves accepted ones open), and a
    client that went away ends its handler quietly."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await handler(reader, writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def test_http1_pool_reuses_connections_and_names_its_failures() -> None:
    upstream = Upstream().start()
    try:
        p = Http1Pool(upstream.url, max_connections=2, max_keepalive=1)
        path = f"/v2/models/{upstream.model}/infer"
        headers = {"Content-Type": "application/json"}
        for body in (b'{"inputs": []}', b"x" * 100_000):
            reply = await p.request(path, headers, body, 1.0, 1.0)
            assert reply.status == 200
            assert reply.headers["content-type"] == "application/json"
        assert [r.sha256 for r in upstream.received] == [
            hashlib.sha256(b'{"inputs": []}').hexdigest(),
            hashlib.sha256(b"x" * 100_000).hexdigest(),
        ]
        assert upstream.connections == 1  # kept alive between the two
        upstream.mode = "one_shot"  # closes each connection after its answer, silently
        for _ in range(5):
            reply = await p.request(path, headers, b"{}", 1.0, 1.0)
            assert reply.status == 200
        assert len(upstream.received) == 7  # each sent once, though 4 found it closed
        assert upstream.connections >= 5
        upstream.mode = "close"
        with pytest.raises(BrokenReply):
            await p.request(path, headers, b"{}", 1.0, 1.0)
        # On a new connection, a close before the answer is the upstream's doing after it
        # took the request (a crash on it): sent once, not again as if found stale (the
        # model ran twice, and a sequence's step advanced twice, with retries = 0).
        sent = len(upstream.received)
        with pytest.raises(BrokenReply, match="closed the connection unanswered"):
            await Http1Pool(upstream.url, 1, 1).request(path, headers, b"{}", 1.0, 1.0)
        assert len(upstream.received) == sent + 1
        await p.close()
    finally:
        upstream.stop()
    with pytest.raises(ConnectFailed):
        await Http1Pool(upstream.url, 1, 1).request(path, headers, b"{}", 1.0, 1.0)


async def test_http1_pool_waits_for_a_free_connection_only_so_long() -> None:
    upstream = Upstream(delay_s=30).start()
    try:
        p = Http1Pool(upstream.url, max_connections=1, max_keepalive=1)
        path = f"/v2/models/{upstream.model}/infer"
        first = asyncio.create_task(p.request(path, {}, b"{}", 1.0, 1.0))
        await eventually(lambda: len(upstream.received) == 1, what="the first request")
        with pytest.raises(PoolTimeout):
            await p.request(path, {}, b"{}", 1.0, 0.05)
        assert len(upstream.received) == 1  # the second never went out
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await p.close()
    finally:
        upstream.stop()


async def reply_of(raw: bytes, max_body: int = 100) -> Reply:
    """What the pool reads of the answer `raw`, taking at most `max_body` bytes of body."""
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    head = await reader.readuntil(b"\r\n\r\n")
    reply, _ = await read_reply(head, reader, max_body)
    return reply


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length '-1'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello", "bad Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
            "bad chunk size",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 101\r\n\r\n", "larger than the 0 MB allowed"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"40\r\n"
            + b"x" * 64
            + b"\r\n"
            + b"40\r\n"
            + b"x" * 64
            + b"\r\n0\r\n\r\n",
            "larger than the 0 MB allowed",
        ),
        (b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 101, "larger than the 0 MB allowed"),
    ],
)
async def test_an_upstream_answer_that_is_malformed_or_too_large_is_a_broken_reply(
    raw: bytes, error: str
) -> None:
    """A negative length was a 500 with a traceback a request, its endpoint never ejected;
    an answer of 1.5 GB was held whole twice (3 GB) while the event loop stalled 9.9 s for
    every tenant. Each is a broken reply now (a 502, counted against the endpoint), read
    no further than `max_answer_mb`."""
    with pytest.raises(BrokenReply, match=error):
        await reply_of(raw)


async def test_an_upstream_answer_at_the_limit_is_read_whole() -> None:
    for raw in (
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n"
        + b"x" * 100
        + b"\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 100,
    ):
        assert (await reply_of(raw)).body == b"x" * 100


def hostile_health(mode: str) -> Handler:
    """An endpoint whose GET /v2/health/ready answers 200 with a chunked body that never
    ends ("endless": 64 KB chunks as fast as they go) or drips a byte every 50 ms."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            if mode == "endless":
                writer.write(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
            else:
                writer.write(b"1\r\nx\r\n")
                await asyncio.sleep(0.05)  # (the drip itself, not a test's wait)
            await writer.drain()

    return serve


@pytest.mark.parametrize("mode", ["endless", "drip"])
async def test_a_health_check_is_bounded_in_size_and_time(mode: str) -> None:
    """httpx's timeout bounds each read, not an answer: an endpoint whose health answer
    never ended grew the gateway by 2.7 GB in 12 s, and one that dripped a byte at a time
    held every endpoint's checks (they run as one round) for good. A check now fails past
    4 MB or past health_timeout_s, whole, and the round goes on."""
    # The endless answer ends by its size, whatever the machine's speed: its check's time is
    # not what the verdict reads.
    timeout_s = 60.0 if mode == "endless" else 0.5
    async with serving(hostile_health(mode)) as endpoint:
        pool = RemotePool(RemoteConfig((endpoint,), health_timeout_s=timeout_s), FakeClock())
        try:
            await pool.check_health()
            state = pool.health.states[endpoint]
            assert state.fails == 1
            why = (
                "larger than the 4 MB allowed"
                if mode == "endless"
                else "no whole answer within 0.5 s"
            )
            assert why in (state.last_error or "")
        finally:
            await pool.close()


async def test_connection_slots_go_by_class_then_tenants_in_turn() -> None:
    """A remote endpoint's connections were a semaphore, first come first served: tenant
    A's 40 requests in flight held B's lone request 10 s, and a burst request got a 504
    behind batch ones. A free slot now goes to the best class waiting, and within a class
    to the tenants in turn."""
    slots = FairSlots(1)
    await slots.acquire((2, "a"))  # the one slot, held
    order: list[str] = []

    def wait(rank: int, tenant: str, name: str) -> asyncio.Task[None]:
        async def take() -> None:
            await slots.acquire((rank, tenant))
            order.append(name)

        return asyncio.create_task(take())

    waiting = [wait(2, "a", f"a{i}") for i in range(1, 4)]
    waiting.append(wait(2, "b", "b1"))
    await asyncio.sleep(0)  # (each task runs to its wait)
    waiting.append(wait(0, "c", "c-realtime"))  # last in, best class
    gone = wait(2, "b", "b-gone")
    await asyncio.sleep(0)
    gone.cancel()  # gave up waiting: never served
    for _ in range(5):
        slots.release()
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert order == ["c-realtime", "a1", "b1", "a2", "a3"]
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    slots.release()  # the last holder's: nobody waits, the slot is free again
    await asyncio.wait_for(slots.acquire((2, "z")), 1)


async def test_an_answer_to_the_connection_s_end_is_read_to_its_end() -> None:
    """An answer without a length, delimited by the connection's end, was cut to what
    had arrived at the first read: a 200 with part of its body."""
    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.0 200 OK\r\n\r\n" + b"a" * 60)
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, reader.feed_data, b"b" * 40)  # (the rest arrives later)
    loop.call_later(0.02, reader.feed_eof)
    head = await reader.readuntil(b"\r\n\r\n")
    reply, keep = await read_reply(head, reader, 100)
    assert (reply.body, keep) == (b"a" * 60 + b"b" * 40, False)


async def test_interim_answers_are_skipped_and_never_answer_the_next_request() -> None:
    """An upstream's 103 Early Hints before its 200 was taken as the answer (a 502), and
    the 200 stayed unread on the kept connection: the next request, perhaps another
    tenant's, got it."""
    served = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            served += 1
            body = b"answer%d" % served
            writer.write(
                b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
                + b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()

    async with serving(serve) as url:
        pool = Http1Pool(url, 1, 1)
        try:
            for n in (1, 2, 3):
                reply = await pool.request("/v2/models/m/infer", {}, b"{}", 1.0, 1.0)
                assert (reply.status, reply.body) == (200, b"answer%d" % n)
        finally:
            await pool.close()
