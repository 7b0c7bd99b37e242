"""Front processes in front of one engine, as a throwaway prototype beside the real gateway
(issue 16: the one lever left that uses the second core, priced by `front_hop.py`).

The prototype: one engine process builds the gateway as `infergate serve` does
(`build_gateway`: engine, workers, `InferRoute`) but serves no HTTP itself; N front
processes share the listening port (SO_REUSEPORT), parse HTTP with httptools and hand each
infer request (its path's model and version, its headers, its body) to the engine over a
Unix socket, the messages of one event-loop step as one pickle each way. The engine answers
each with `InferRoute.reply`, the function that answers the gateway's own infer requests
(authentication, admission, decoding, the engine, encoding, metrics), so the engine's work
per request is the gateway's, and the fronts' is HTTP alone. What the fronts leave out
(the edge limits and deadlines, the access log, the drain, every other route) costs the
real gateway a few µs per request: the prototype flatters the split by that much.

Measured like `benchmarks/http_cpu.py` (whose helpers this uses): the tiny MLP with JSON
tensors at c=64 from 64 keep-alive connections, CPU per request of the serving processes
(engine and fronts, or the gateway) and of the model workers, and requests/s, the real
gateway and the split alternated round by round.

    .venv/bin/python benchmarks/front_split.py [--fronts 2] [--requests 20000] [--rounds 6]
        [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import httptools
import orjson
import uvloop
from front_hop import Framed
from http_cpu import ROOT, Served, measure, tiny_setup, worker_pids
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from infergate.server.infer_route import INFER_PATH
from tests.server import ServerProcess, free_port, wait_ready

# -- the engine process ------------------------------------------------------------------


async def _engine(models: Path, profile: Path, port: int, fronts: int, work: Path) -> None:
    from infergate.profile import load_profile
    from infergate.server.gateway import build_gateway
    from infergate.server.views import model_status

    gateway = build_gateway(load_profile(profile), models)
    await gateway.engine.start()
    while not (gateway.engine.ready and gateway.engine.version_view("tiny").ready):
        await asyncio.sleep(0.05)
    route, loop = gateway.route, asyncio.get_running_loop()

    def serve_hop() -> Framed:
        hop: Framed

        async def answer(
            rid: int, name: str, version: str | None, headers: Any, body: bytes
        ) -> None:
            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            reply = await route.reply(name, version, headers, receive)
            reply.keeper.free_buffers()
            hop.send((rid, reply.status, reply.headers, reply.body))

        hop = Framed(lambda _, message: loop.create_task(answer(*message)), coalesce=True)
        return hop

    path = str(work / "hop.sock")
    await loop.create_unix_server(serve_hop, path)
    status = model_status(gateway.engine.model_view("tiny"))
    (work / "split_workers.json").write_bytes(
        orjson.dumps([i["pid"] for v in status["versions"] for i in v["instances"]])
    )
    for _ in range(fronts):
        subprocess.Popen([sys.executable, __file__, "--front", path, str(port)])
    await asyncio.Event().wait()


# -- a front process -----------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, infer requests to the engine, and a
    200 for any GET (the readiness probe). No pipelining, limits or other routes."""

    ids = itertools.count()

    def __init__(self, hop: Framed, waiting: dict[int, _Client]) -> None:
        self.hop, self.waiting = hop, waiting
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.headers, self.body = b"", [], []  # type: ignore[var-annotated]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_method() == b"GET":
            self.answer(200, [(b"content-type", b"application/json")], b'{"ready":true}')
            return
        match = INFER_PATH.match(self.url.partition(b"?")[0].decode("latin-1"))
        if match is None:
            self.answer(404, [], b"")
            return
        rid = next(self.ids)
        self.waiting[rid] = self
        self.hop.send((rid, match.group(1), match.group(2), self.headers, b"".join(self.body)))

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        parts = [STATUS_LINE[status]]
        for name, value in headers:
            if name != b"content-length":
                parts += (name, b": ", value, b"\r\n")
        parts += (b"content-length: %d\r\n\r\n" % len(body), body)
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(b"".join(parts))


async def _front(path: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    waiting: dict[int, _Client] = {}

    def answered(_: Framed, message: Any) -> None:
        rid, status, headers, body = message
        waiting.pop(rid).answer(status, headers, body)

    _, hop = await loop.create_unix_connection(lambda: Framed(answered, coalesce=True), path)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    server = await loop.create_server(lambda: _Client(hop, waiting), sock=sock)
    Path(path).with_name(f"front-{os.getpid()}.ready").touch()  # listening: counted in
    await server.serve_forever()


# -- the measurement -----------------------------------------------------------------------


def _start_split(work: Path, models: Path, profile: Path, fronts: int) -> tuple[Any, Served]:
    port = free_port()
    log = work / "split.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    command = [sys.executable, __file__, "--engine", str(models), str(profile), str(port)]
    process = subprocess.Popen(
        [*command, str(fronts), str(work)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, log)
    deadline = time.monotonic() + 60
    while len(list(work.glob("front-*.ready"))) < fronts:  # every front takes connections
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"the fronts did not all start:\n{log.read_text()}")
        time.sleep(0.05)
    workers = orjson.loads((work / "split_workers.json").read_bytes())
    return process, Served(f"split-{fronts}", url, process.pid, workers)


def main() -> None:
    if sys.argv[1:2] == ["--engine"]:
        models, profile, port, fronts, work = sys.argv[2:7]
        uvloop.run(_engine(Path(models), Path(profile), int(port), int(fronts), Path(work)))
        return
    if sys.argv[1:2] == ["--front"]:
        uvloop.run(_front(sys.argv[2], int(sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fronts", type=int, default=2)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 3_000, 1
    work = Path(tempfile.mkdtemp(prefix="infergate-split-"))
    models, profile, body, headers = tiny_setup(work)
    gateway = ServerProcess(models, profile, work / "gateway.log").start()
    split_process = None
    try:
        assert gateway.process is not None
        servers = {
            "gateway": Served("gateway", gateway.url, gateway.process.pid, worker_pids(gateway.url))
        }
        split_process, servers["split"] = _start_split(work, models, profile, args.fronts)
        for server in servers.values():
            measure(server, body, headers, min(args.requests, 5_000), args.concurrency)
        cells: dict[str, list[list[float]]] = {name: [] for name in servers}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                cells[name].append(
                    measure(servers[name], body, headers, args.requests, args.concurrency)
                )
    finally:
        gateway.stop()
        if split_process is not None:
            os.killpg(split_process.pid, 9)
            split_process.wait()
    report: dict[str, Any] = {
        name: {
            "serving_cpu_us_per_request": round(statistics.median(r[0] for r in rows), 1),
            "workers_cpu_us_per_request": round(statistics.median(r[1] for r in rows), 1),
            "requests_per_s": round(statistics.median(r[2] for r in rows)),
        }
        for name, rows in cells.items()
    }
    ratios = [s[2] / g[2] for s, g in zip(cells["split"], cells["gateway"], strict=True)]
    report["split_requests_per_s_ratio"] = round(statistics.median(ratios), 3)
    report["fronts"] = args.fronts
    report["load_average"] = os.getloadavg()[0]
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    print(
        f"tiny MLP, JSON, c={args.concurrency}, median of {args.rounds} rounds of "
        f"{args.requests} (load average {report['load_average']:.1f}):"
    )
    for name in servers:
        row = report[name]
        print(
            f"  {name:8s} {row['requests_per_s']:6d} req/s; CPU per request: serving "
            f"{row['serving_cpu_us_per_request']:5.1f} µs, workers "
            f"{row['workers_cpu_us_per_request']:4.1f} µs"
        )
    print(
        f"  the split ({args.fronts} fronts) over the gateway, req/s, median of the rounds' "
        f"ratios: {report['split_requests_per_s_ratio']}"
    )


if __name__ == "__main__":
    main()
