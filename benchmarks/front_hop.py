"""What would one more process hop per request cost? (issue 16: the price of splitting the
gateway into front processes, which parse HTTP and JSON, in front of one engine process,
which admits, batches and drives the workers.)

Two processes on a socketpair, each with a uvloop event loop, as a front and an engine
would be: the front sends each request as one length-prefixed pickle (request id, model,
version, tenant, parameters and the tiny MLP's 1x64 FP32 input), keeping `--concurrency`
of them outstanding; the engine answers each with the 1x10 FP32 output at once. Printed:
the CPU time each side spends per request (the front's includes its future per request,
which a real front would also have), and the round trips per second. Nothing here is
infergate's code: it prices the hop before anyone builds it.

    .venv/bin/python benchmarks/front_hop.py [--requests 40000] [--concurrency 64]
        [--coalesce] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import uvloop

_LENGTH = struct.Struct("!I")


class Framed(asyncio.Protocol):
    """Length-prefixed pickles in both directions; each whole one to `on_message`. With
    `coalesce`, the messages sent in one event-loop step go as one pickle (a list) at its
    end, and a list received is taken apart: the hop's price when it is paid per burst."""

    def __init__(self, on_message: Callable[[Framed, Any], None], coalesce: bool) -> None:
        self._buf = bytearray()
        self._on_message = on_message
        self.transport: asyncio.Transport | None = None
        self._coalesce = coalesce
        self._pending: list[Any] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        buf, pos, messages = self._buf, 0, []
        buf += data
        while len(buf) - pos >= 4:
            (size,) = _LENGTH.unpack_from(buf, pos)
            if len(buf) - pos - 4 < size:
                break
            messages.append(pickle.loads(memoryview(buf)[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        del buf[:pos]
        for message in messages:
            if self._coalesce:
                for one in message:
                    self._on_message(self, one)
            else:
                self._on_message(self, message)

    def send(self, message: Any) -> None:
        if not self._coalesce:
            self._write(message)
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(message)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self._write(pending)

    def _write(self, message: Any) -> None:
        assert self.transport is not None
        body = pickle.dumps(message, protocol=5)
        self.transport.write(_LENGTH.pack(len(body)) + body)


def _engine(sock: socket.socket, report: socket.socket, coalesce: bool) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        y = np.zeros((1, 10), np.float32)
        answered = 0

        def on_message(proto: Framed, message: Any) -> None:
            nonlocal answered
            if message is None:
                done.set_result(answered)
                return
            answered += 1
            proto.send((message[0], 200, {"y": y}))

        await loop.create_connection(lambda: Framed(on_message, coalesce), sock=sock)
        started = time.process_time()  # the first message starts the measured stretch
        count = await done
        report.sendall(json.dumps((time.process_time() - started) * 1e6 / count).encode())

    uvloop.run(main())


async def _front(
    sock: socket.socket, requests: int, concurrency: int, coalesce: bool
) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    waiting: dict[int, asyncio.Future[Any]] = {}

    def on_message(_: Framed, message: Any) -> None:
        waiting.pop(message[0]).set_result(message)

    _, proto = await loop.create_connection(lambda: Framed(on_message, coalesce), sock=sock)
    ids = iter(range(requests))

    async def client(count: int) -> None:
        for _ in range(count):
            request_id = next(ids)
            answer: asyncio.Future[Any] = loop.create_future()
            waiting[request_id] = answer
            proto.send((request_id, "tiny", None, "default", {}, {"x": x}))
            await answer

    shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client(n) for n in shares))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    proto.send(None)
    return cpu * 1e6 / requests, requests / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--coalesce", action="store_true", help="one message per event-loop step each way"
    )
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests = 4_000
    front_end, engine_end = socket.socketpair()
    report_read, report_write = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the engine: only what it inherits, nothing of the front's loop
        front_end.close()
        report_read.close()
        _engine(engine_end, report_write, args.coalesce)
        os._exit(0)
    engine_end.close()
    report_write.close()
    front_us, rate = uvloop.run(_front(front_end, args.requests, args.concurrency, args.coalesce))
    engine_us = json.loads(report_read.recv(64))
    os.waitpid(pid, 0)
    result = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "coalesce": args.coalesce,
        "front_cpu_us_per_request": round(front_us, 1),
        "engine_cpu_us_per_request": round(engine_us, 1),
        "round_trips_per_s": round(rate),
        "load_average_1m": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"one hop{', coalesced' if args.coalesce else ''}, {args.requests} requests at "
        f"concurrency {args.concurrency}: "
        f"front {result['front_cpu_us_per_request']} µs, engine "
        f"{result['engine_cpu_us_per_request']} µs of CPU per request; "
        f"{result['round_trips_per_s']:,} round trips/s "
        f"(load average {result['load_average_1m']:.1f})"
    )


if __name__ == "__main__":
    main()
