"""The load generator's HTTP client against a real loopback server that sends its
responses in awkward pieces, and one that hangs up."""

from __future__ import annotations

import asyncio

import pytest

from infergate.loadgen import run
from infergate.rawhttp import RawConnection


async def _serve(handler: object) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def test_responses_in_pieces_and_back_to_back_are_each_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(3):
            body = (await _read_request(reader)) * (i + 1)
            response = (
                b"HTTP/1.1 201 Created\r\nX-Seq: %d\r\nContent-Length: %d\r\n\r\n" % (i, len(body))
                + body
            )
            for k in range(0, len(response), 7):  # seven bytes at a time, head and body
                writer.write(response[k : k + 7])
                await writer.drain()
                await asyncio.sleep(0)
        writer.close()

    async def exchange() -> list[tuple[int, str, bytes]]:
        server, url = await _serve(handler)
        async with server:
            conn = await RawConnection.open(url)
            prepared = conn.request_bytes("POST", "/x", b"abc")
            got = []
            for _ in range(3):
                response = await conn.send(prepared)
                seq = response.head.split(b"X-Seq: ")[1].split(b"\r\n")[0].decode()
                got.append((response.status, seq, response.body))
            await conn.close()
            return got

    async def scenario() -> list[tuple[int, str, bytes]]:
        return await asyncio.wait_for(exchange(), 20)  # a lost response fails, not hangs

    assert run(scenario()) == [  # on uvloop, as the load generator runs
        (201, "0", b"abc"),
        (201, "1", b"abcabc"),
        (201, "2", b"abcabcabc"),
    ]


def test_a_server_that_hangs_up_raises_connection_errors() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")  # 4 of 10 bytes
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server, url = await _serve(handler)
        async with server:
            conn = await RawConnection.open(url)
            prepared = conn.request_bytes("POST", "/x", b"abc")
            with pytest.raises(OSError, match="closed"):
                await conn.send(prepared)
            with pytest.raises(OSError, match="closed"):  # it stays unusable: reconnect
                await conn.send(prepared)

    asyncio.run(scenario())  # and on plain asyncio
