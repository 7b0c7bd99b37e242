"""What server/http_protocol.py's one write (a response's head and body in one send) gains
on its own: the same small ASGI app served by uvicorn with three protocols, side by side.

    .venv/bin/python benchmarks/http_protocol.py [--quick] [--json]

- `httptools`: uvicorn's own HttpToolsProtocol, as `uvicorn --http httptools` runs it.
- `limits`: ours with the one write turned off (`one_write = False`): the connection
  limits and deadlines only.
- `ours`: GatewayHttpProtocol as `infergate serve` runs it: the limits and the one write.

The one write's gain is `ours` against `limits`; `httptools` shows what the limits cost.
Each server runs in its own process; a raw keep-alive client (infergate/rawhttp.py) sends
the same 100-byte POST on 1 connection, then on 16, to each server in turn, for `rounds`
rounds, so that a busy neighbour on a shared machine hits every variant alike. Reported
per variant and concurrency: requests/s, p50 and p99 latency, and the server process's
CPU time per request (user + system, from /proc through psutil): the steadiest figure on
a shared machine, and the one the saved system calls show in.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.rawhttp import RawConnection  # noqa: E402

VARIANTS = ("httptools", "limits", "ours")
CONCURRENCY = (1, 16)
BODY = b'{"outputs":[{"name":"y","datatype":"FP32","shape":[1,4],"data":[1.0,2.0,3.0,4.0]}]}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A stand-in for an inference answer: read the body, send a small JSON one."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(BODY)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": BODY})


def serve(variant: str, port: int) -> None:
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from infergate.server.http_protocol import GatewayHttpProtocol

    protocol: type[HttpToolsProtocol] = HttpToolsProtocol
    if variant == "ours":
        protocol = GatewayHttpProtocol
    elif variant == "limits":
        protocol = type("LimitsOnly", (GatewayHttpProtocol,), {"one_write": False})
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=protocol,
        loop="uvloop",
        log_level="warning",
        access_log=False,
        server_header=False,
        proxy_headers=False,
        lifespan="off",
    )
    uvicorn.Server(config).run()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(variant: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", variant, "--port", str(port)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return process, f"http://127.0.0.1:{port}"


async def _wait_up(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            connection = await RawConnection.open(url)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no server at {url} after {timeout_s} s") from None
            await asyncio.sleep(0.05)
            continue
        await connection.close()
        return


async def _phase(url: str, pid: int, concurrency: int, seconds: float) -> dict[str, float]:
    connections = [await RawConnection.open(url) for _ in range(concurrency)]
    request = connections[0].request_bytes("POST", "/infer", b'{"x":1}')
    latencies: list[float] = []

    async def caller(connection: RawConnection, until: float) -> None:
        while (start := time.perf_counter()) < until:
            response = await connection.send(request)
            latencies.append(time.perf_counter() - start)
            if response.status != 200:
                raise RuntimeError(f"status {response.status}")

    server = psutil.Process(pid)
    await asyncio.gather(*(caller(c, time.perf_counter() + 0.2) for c in connections))  # warm
    latencies.clear()
    cpu = sum(server.cpu_times()[:2])
    started = time.perf_counter()
    await asyncio.gather(*(caller(c, started + seconds) for c in connections))
    wall = time.perf_counter() - started
    cpu = sum(server.cpu_times()[:2]) - cpu
    for connection in connections:
        await connection.close()
    latencies.sort()
    return {
        "requests_per_s": len(latencies) / wall,
        "p50_us": latencies[len(latencies) // 2] * 1e6,
        "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
        "server_cpu_us_per_request": cpu / len(latencies) * 1e6,
    }


async def measure(seconds: float, rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    servers = {v: _start(v) for v in VARIANTS}
    try:
        for _, url in servers.values():
            await _wait_up(url)
        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        for _ in range(rounds):
            for concurrency in CONCURRENCY:
                for variant in VARIANTS:  # alternating, so noise hits every variant alike
                    process, url = servers[variant]
                    result = await _phase(url, process.pid, concurrency, seconds)
                    runs.setdefault((variant, concurrency), []).append(result)
    finally:
        for process, _ in servers.values():
            process.terminate()
        for process, _ in servers.values():
            process.wait(10)
    report: dict[str, dict[str, dict[str, float]]] = {}
    for (variant, concurrency), results in runs.items():
        report.setdefault(variant, {})[f"c{concurrency}"] = {
            key: round(statistics.median(r[key] for r in results), 1) for key in results[0]
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    seconds, rounds = (1.0, 2) if args.quick else (3.0, 5)
    report = uvloop.run(measure(seconds, rounds))
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    print(f"{'variant':10} {'conc':>4} {'req/s':>8} {'p50 µs':>8} {'p99 µs':>8} {'cpu µs/req':>10}")
    for variant, by_concurrency in report.items():
        for concurrency, r in by_concurrency.items():
            print(
                f"{variant:10} {concurrency:>4} {r['requests_per_s']:8.0f} {r['p50_us']:8.0f} "
                f"{r['p99_us']:8.0f} {r['server_cpu_us_per_request']:10.1f}"
            )


if __name__ == "__main__":
    main()
