"""What a flood of requests whose clients leave costs another tenant.

One tenant ("flood") sends valid JSON bodies of about 1 MB (3,200 rows of the tiny MLP's 64
inputs; `--rows`) from several threads, each on a new connection closed as soon as the request is
sent, never reading an answer; another ("light") sends one-row requests one after another
on one kept-alive connection, as a client library does. Printed: the light tenant's
latency while the flood runs and after it, how many requests the flood sent, and how the
gateway answered them (`infergate_requests_total`: 499 is a request whose client had left,
for which nothing was decoded or run; server/departure.py).

    .venv/bin/python benchmarks/departed_flood.py [--seconds 10] [--threads 4] [--fronts 0]
        [--rows 3200] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.engine.admission.tenants import hash_key  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

FLOOD, LIGHT = "flood-key", "light-key"
PATH = "/v2/models/tiny/infer"


def _request(rows: int, key: str) -> bytes:
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [rows, 64], "datatype": "FP32",
                     "data": [0.5] * (64 * rows)}]}
    ).encode()  # fmt: skip
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-API-Key: {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def _answer(sock: socket.socket) -> int:
    """Read one response (Content-Length framed); its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length:\s*(\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split(b" ", 2)[1])


def run(seconds: float, threads: int, fronts: int, rows: int = 3200) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="infergate-flood-"))
    models = root / "models"
    make_mlp(models / "tiny" / "1" / "model.onnx", sizes=(64, 128, 10))
    (models / "tiny" / "model.toml").write_text(
        "instances = 2\nthreads = 1\n[batching]\nmax_batch_size = 32\nmax_queue_delay_ms = 5\n"
    )
    profile = root / "profile.toml"
    profile.write_text(
        f"[server]\nfronts = {fronts}\n"
        f'[tenants.flood]\napi_keys = ["{hash_key(FLOOD)}"]\n'
        f'[tenants.light]\napi_keys = ["{hash_key(LIGHT)}"]\n'
    )
    server = ServerProcess(models, profile, root / "server.log").start()
    try:
        flood_message, light_message = _request(rows, FLOOD), _request(1, LIGHT)
        stop = time.monotonic() + seconds
        sent = [0]

        def flood() -> None:
            while time.monotonic() < stop:
                try:
                    with socket.create_connection(("127.0.0.1", server.port)) as sock:
                        sock.sendall(flood_message)
                    sent[0] += 1
                except OSError:
                    pass

        light = socket.create_connection(("127.0.0.1", server.port))
        light.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        light.sendall(light_message)
        _answer(light)
        workers = [threading.Thread(target=flood, daemon=True) for _ in range(threads)]
        for worker in workers:
            worker.start()
        during: list[float] = []
        after: list[float] = []
        statuses: set[int] = set()
        end = stop + seconds
        while (now := time.monotonic()) < end:
            light.sendall(light_message)
            statuses.add(_answer(light))
            (during if now < stop else after).append(time.monotonic() - now)
        light.close()
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        answered = {
            f"{tenant} {status}": float(count)
            for status, tenant, count in re.findall(
                r'infergate_requests_total\{model="tiny",status="(\d+)",tenant="(\w+)"\} (\S+)',
                metrics,
            )
        }
    finally:
        server.stop()

    def ms(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

    return {
        "flood_sent": sent[0],
        "light_statuses": sorted(statuses),
        "light_during": {"n": len(during), "p50_ms": ms(during, 0.5), "p99_ms": ms(during, 0.99),
                         "max_ms": round(max(during) * 1000, 1),
                         "mean_ms": round(statistics.fmean(during) * 1000, 1)},
        "light_after": {"n": len(after), "p50_ms": ms(after, 0.5),
                        "max_ms": round(max(after) * 1000, 1)},
        "answered": answered,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="of flood, then as long after")
    parser.add_argument("--threads", type=int, default=4, help="flooding threads")
    parser.add_argument("--fronts", type=int, default=0, help="the gateway's [server] fronts")
    parser.add_argument("--rows", type=int, default=3200, help="of a flood request (320 B each)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.seconds, args.threads, args.fronts, args.rows)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    during, after = result["light_during"], result["light_after"]
    print(
        f"flood: {result['flood_sent']} requests of {args.rows} rows ({args.rows * 320 // 1000} "
        "KB) sent, each connection closed at once"
    )
    print(f"light tenant while flooded: {during}")
    print(f"light tenant after:         {after}")
    print(f"answered (tenant status: count): {result['answered']}")
    if result["light_statuses"] != [200]:
        print(f"the light tenant got {result['light_statuses']}: not a measurement")


if __name__ == "__main__":
    main()
