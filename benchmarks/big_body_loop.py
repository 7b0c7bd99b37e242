"""The gateway's event loop while a 60 MB body comes in, is decoded and is let go of.

    .venv/bin/python benchmarks/big_body_loop.py [--kind json|bytes] [--rounds 3] [--json]

The gateway (build_gateway, uvicorn with GatewayHttpProtocol on uvloop, as `infergate
serve` runs it) serves in this process, with a heartbeat task on its loop that sleeps 1 ms
at a time and notes each turn's lag and the CPU time the loop's thread spent meanwhile
(time.thread_time). A client process sends the body of test_edge_requests' health test
(60 MB of JSON numbers, or a million 60-byte BYTES elements as binary data) to a model that
refuses it after decoding it, `--rounds` times.

The figure is the loop's longest turn in CPU time, per round, from the first byte sent to
half a second after the answer: work the loop did in one go, which nothing else could
interleave. Wall-clock lags are shown too, but on a busy machine they mostly measure time
the process was not running (hundreds of milliseconds with under 2 ms of CPU, at a load of
6 to 8 on 2 cores); the idle second before each round gives that baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.cli.serve import _tune_gc  # noqa: E402
from infergate.profile import load_profile  # noqa: E402
from infergate.server.gateway import build_gateway  # noqa: E402
from infergate.server.http_protocol import GatewayHttpProtocol  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import free_port  # noqa: E402

# The client: one request per round, each after a quiet second; prints when each was sent
# and answered (the system's monotonic clock, which this process reads too).
CLIENT = """
import sys, time, orjson, numpy as np
from tests.edge_raw import connect, head, read_reply
from tests.test_edge_requests import _big_bytes_body, _big_json_body
port, kind, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
body, extra = (_big_json_body if kind == "json" else _big_bytes_body)()
headers = {"Content-Length": str(len(body)), **extra}
rows = []
for _ in range(rounds):
    time.sleep(1.5)
    with connect(port) as sock:
        start = time.monotonic()
        sock.sendall(head("POST", "/v2/models/mlp/infer", port, headers) + body)
        reply = read_reply(sock, timeout_s=300)
        rows.append((start, time.monotonic(), reply.status if reply else None))
print(orjson.dumps(rows).decode())
"""


async def measure(kind: str, rounds: int) -> list[dict[str, Any]]:
    import uvicorn

    work = Path(tempfile.mkdtemp(prefix="infergate-bigbody-"))
    make_mlp(work / "models" / "mlp" / "1" / "model.onnx")
    (work / "profile.toml").write_text("[server]\nmax_request_mb = 100\n")
    _, app, _ = build_gateway(load_profile(work / "profile.toml"), work / "models")
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=GatewayHttpProtocol, log_level="warning"
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    turns: list[tuple[float, float, float]] = []  # (start, wall lag, loop CPU), monotonic
    collections: list[tuple[float, float]] = []  # (end, seconds): the collector's, to tell
    began = [0.0]

    def collected(phase: str, _: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.monotonic()
        else:
            collections.append((time.monotonic(), time.monotonic() - began[0]))

    gc.callbacks.append(collected)
    _tune_gc()  # as `infergate serve` does

    async def heartbeat() -> None:
        while True:
            start, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(0.001)
            turns.append((start, time.monotonic() - start - 0.001, time.thread_time() - cpu))

    while not server.started:
        await asyncio.sleep(0.05)
    beating = asyncio.create_task(heartbeat())
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT,
        str(port),
        kind,
        str(rounds),
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    out, _ = await client.communicate()
    await asyncio.sleep(0.5)  # what is freed after the answer
    beating.cancel()
    server.should_exit = True
    await serving
    results = []
    for start, answered, status in orjson.loads(out):
        during = [t for t in turns if start <= t[0] <= answered + 0.5]
        idle = [t for t in turns if start - 1.0 <= t[0] < start]
        gcs = [s for end, s in collections if start <= end <= answered + 0.5]
        results.append(
            {
                "status": status,
                "seconds": round(answered - start, 2),
                "longest_cpu_ms": round(1000 * max(t[2] for t in during), 1),
                "longest_wall_ms": round(1000 * max(t[1] for t in during), 1),
                "idle_longest_cpu_ms": round(1000 * max(t[2] for t in idle), 1),
                "idle_longest_wall_ms": round(1000 * max(t[1] for t in idle), 1),
                "longest_gc_ms": round(1000 * max(gcs, default=0.0), 1),
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("json", "bytes"), default="json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results = runner.run(measure(args.kind, args.rounds))
    if args.json:
        print(orjson.dumps(results).decode())
        return
    for i, r in enumerate(results):
        print(
            f"{args.kind} round {i}: answered {r['status']} in {r['seconds']} s; the loop's "
            f"longest turn {r['longest_cpu_ms']} ms of CPU ({r['longest_wall_ms']} ms wall); "
            f"idle second before: {r['idle_longest_cpu_ms']} ms CPU "
            f"({r['idle_longest_wall_ms']} ms wall); longest garbage collection "
            f"{r['longest_gc_ms']} ms"
        )


if __name__ == "__main__":
    main()
