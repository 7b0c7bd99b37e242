"""Serving overhead: a tiny MLP (64->128->10) through the gateway vs onnxruntime in-process,
measured in one run on the same machine.

    .venv/bin/python benchmarks/serving_overhead.py [--quick] [--json]

Reports p50/p99 latency at concurrency 1 and requests/s at concurrency 16, with JSON and
binary tensors. The figure of merit is the added p50 at concurrency 1 with binary tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.client import encode_infer_request  # noqa: E402
from infergate.rawhttp import RawConnection  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import ServerProcess  # noqa: E402


@dataclass
class Row:
    path: str
    concurrency: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def direct(
    session: ort.InferenceSession, x: np.ndarray, concurrency: int, count: int, duration_s: float
) -> Row:
    latencies: list[float] = []
    stop = time.perf_counter() + duration_s

    def loop() -> None:
        done = 0
        while done < count and time.perf_counter() < stop:
            t0 = time.perf_counter()
            session.run(["y"], {"x": x})
            latencies.append(time.perf_counter() - t0)
            done += 1

    for _ in range(50):
        session.run(["y"], {"x": x})
    started = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return Row(
        "onnxruntime in-process",
        concurrency,
        len(latencies),
        len(latencies) / elapsed,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
    )


async def gateway(
    url: str, x: np.ndarray, binary: bool, concurrency: int, count: int, duration_s: float
) -> Row:
    body, headers = encode_infer_request({"x": x}, binary=binary)
    latencies: list[float] = []
    errors = 0

    async def client(conn: RawConnection) -> None:
        nonlocal errors
        prepared = conn.request_bytes("POST", "/v2/models/mlp/infer", body, headers)
        done = 0
        while done < count and time.perf_counter() < stop:
            t0 = time.perf_counter()
            response = await conn.send(prepared)
            latencies.append(time.perf_counter() - t0)
            errors += response.status != 200
            done += 1

    conns = [await RawConnection.open(url) for _ in range(concurrency)]
    warm = conns[0].request_bytes("POST", "/v2/models/mlp/infer", body, headers)
    for _ in range(50):
        assert (await conns[0].send(warm)).status == 200
    stop = time.perf_counter() + duration_s
    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in conns))
    elapsed = time.perf_counter() - started
    for c in conns:
        await c.close()
    if errors:
        raise RuntimeError(f"{errors} requests failed")
    kind = "binary" if binary else "JSON"
    return Row(
        f"gateway, {kind} tensors",
        concurrency,
        len(latencies),
        len(latencies) / elapsed,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    count, duration = (300, 1.0) if args.quick else (3000, 5.0)

    work = Path(tempfile.mkdtemp(prefix="infergate-bench-"))
    model = make_mlp(work / "models" / "mlp" / "1" / "model.onnx", sizes=(64, 128, 10))
    profile = work / "profile.toml"
    # The benchmark measures serving, not the default tenant's rate limit.
    profile.write_text(
        "[tenants.default]\nrps = 1000000\nburst = 1000000\nmax_concurrency = 10000\n"
    )
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)

    options = ort.SessionOptions()
    options.inter_op_num_threads = 1  # as the workers run it
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    rows = [direct(session, x, 1, count, duration), direct(session, x, 16, 10**9, duration)]
    del session

    server = ServerProcess(work / "models", profile, work / "server.log").start()
    try:
        for binary in (True, False):
            rows.append(asyncio.run(gateway(server.url, x, binary, 1, count, duration)))
            rows.append(asyncio.run(gateway(server.url, x, binary, 16, 10**9, duration)))
    finally:
        server.stop()

    base = rows[0].p50_ms
    if args.json:
        print(orjson.dumps([asdict(r) for r in rows], option=orjson.OPT_INDENT_2).decode())
        return
    print(f"{'path':28} {'conc':>4} {'requests':>8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(
            f"{r.path:28} {r.concurrency:4d} {r.requests:8d} {r.rps:9.0f} {r.p50_ms:8.3f} "
            f"{r.p99_ms:8.3f}"
        )
    binary_c1 = next(r for r in rows if r.path.startswith("gateway, binary") and r.concurrency == 1)
    print(
        f"\nadded p50 at concurrency 1, binary tensors: {binary_c1.p50_ms - base:.3f} ms "
        f"(goal: under 1 ms)"
    )


if __name__ == "__main__":
    main()
