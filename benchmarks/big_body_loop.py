"""The gateway's event loop while a 60 MB body comes in, is decoded and is let go of.

    .venv/bin/python benchmarks/big_body_loop.py [--kind KIND] [--rounds 3] [--json]

The gateway (build_gateway, uvicorn with GatewayHttpProtocol on uvloop, as `infergate
serve` runs it) serves in this process, with a heartbeat task on its loop that sleeps 1 ms
at a time and notes each turn's lag and the CPU time the loop's thread spent meanwhile
(time.thread_time). A client process sends the body of test_edge_requests' health test
(60 MB of JSON numbers, or a million 60-byte BYTES elements as binary data) to a model that
refuses it after decoding it, `--rounds` times. The answer's side: `--kind answer-json`,
`answer-gzip` or `answer-binary` sends 60 MB of FP32 numbers as binary data to an identity
model and reads its 60 MB answer back, as JSON (about 160 MB of text), as JSON with
`Accept-Encoding: gzip`, or as binary data. Their longest turn is often the engine's, not
the answer's: the worker's 60 MB output copied out of its shared memory on the loop
(engine/workers/shm.py), 10 ms to several hundred on a busy 2-core machine.

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
from tests.onnx_models import OPSET, _save, make_mlp  # noqa: E402
from tests.server import free_port  # noqa: E402

# The client: one request per round, each after a quiet second; prints when each was sent
# and answered (the system's monotonic clock, which this process reads too).
CLIENT = """
import sys, time, orjson, numpy as np
from infergate.client import encode_infer_request
from tests.edge_raw import big_json_body, connect, head
from tests.test_edge_requests import _big_bytes_body
port, kind, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
path, extra_headers = "/v2/models/mlp/infer", {}
if kind == "json":
    body, extra = big_json_body()
elif kind == "bytes":
    body, extra = _big_bytes_body()
else:  # the answer's side: 60 MB of FP32 numbers to the identity model, as binary data
    x = np.random.default_rng(0).random((1, 15 << 20), dtype=np.float32)
    body, extra = encode_infer_request({"x": x}, binary=True)  # (asks for binary outputs)
    if kind != "answer-binary":  # the default: JSON outputs
        length = int(extra["Inference-Header-Content-Length"])
        doc = orjson.loads(body[:length])
        del doc["parameters"]["binary_data_output"]
        header = orjson.dumps(doc)
        body = header + body[length:]
        extra["Inference-Header-Content-Length"] = str(len(header))
    path = "/v2/models/ident/infer"
    extra_headers = {"Accept-Encoding": "gzip" if kind == "answer-gzip" else "identity"}
headers = {"Content-Length": str(len(body)), **extra, **extra_headers}
for _ in range(600):  # the models loaded (a round sent before gets 503)
    with connect(port) as sock:
        sock.sendall(head("GET", "/v2/health/ready", port))
        if sock.recv(65536).startswith(b"HTTP/1.1 200"):
            break
    time.sleep(0.1)


def status_of(sock):
    # The answer read to its end (into one buffer: answers here are up to 160 MB).
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    raw_head, _, rest = data.partition(b"\\r\\n\\r\\n")
    lines = raw_head.decode("latin-1").split("\\r\\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    left = int(fields.get("content-length", "0")) - len(rest)
    buffer = bytearray(max(left, 0))
    view = memoryview(buffer)
    while left > 0:
        got = sock.recv_into(view[len(buffer) - left :])
        if not got:
            return None
        left -= got
    return int(lines[0].split()[1])


rows = []
for _ in range(rounds):
    time.sleep(1.5)
    with connect(port) as sock:
        sock.settimeout(300)
        start = time.monotonic()
        sock.sendall(head("POST", path, port, headers) + body)
        rows.append((start, time.monotonic() if (s := status_of(sock)) else 0, s))
print(orjson.dumps(rows).decode())
"""


def _make_identity(path: Path) -> None:
    """x FP32 [batch, n] -> y, the same numbers: an answer as large as the request."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "ident",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
    )
    _save(helper.make_model(graph, opset_imports=OPSET), path)


async def measure(kind: str, rounds: int) -> list[dict[str, Any]]:
    import uvicorn

    work = Path(tempfile.mkdtemp(prefix="infergate-bigbody-"))
    make_mlp(work / "models" / "mlp" / "1" / "model.onnx")
    if kind.startswith("answer"):
        _make_identity(work / "models" / "ident" / "1" / "model.onnx")
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
    parser.add_argument(
        "--kind",
        choices=("json", "bytes", "answer-json", "answer-gzip", "answer-binary"),
        default="json",
    )
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
