"""What limits shared through Redis add to each request: a gateway whose tenant limits
live in Redis ([cluster], a redis-server on loopback) against the same gateway with the
same limits in process, requests sent to the two in turn so both see the same machine.

    .venv/bin/python benchmarks/redis_limits.py [--quick] [--json]

Every request is checked against a rate and a concurrency limit (never reached), so each
one costs the cluster gateway two Redis round trips: the admission script and the lease's
release. Reports p50/p99 at concurrency 1 and the added p99 (goal: under 1 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.client import encode_infer_request  # noqa: E402
from infergate.rawhttp import RawConnection  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.redis_server import RedisProcess  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

LIMITS = "[tenants.default]\nrps = 1000000\nburst = 1000000\nmax_concurrency = 10000\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def measure(urls: dict[str, str], count: int) -> dict[str, list[float]]:
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    body, headers = encode_infer_request({"x": x}, binary=True)
    conns = {name: await RawConnection.open(url) for name, url in urls.items()}
    prepared = {
        name: c.request_bytes("POST", "/v2/models/mlp/infer", body, headers)
        for name, c in conns.items()
    }
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    for i in range(count + 100):  # the first 100 warm up
        for name, conn in conns.items():
            t0 = time.perf_counter()
            response = await conn.send(prepared[name])
            if response.status != 200:
                raise RuntimeError(f"{name}: {response.status} {response.body[:200]!r}")
            if i >= 100:
                latencies[name].append(time.perf_counter() - t0)
    for c in conns.values():
        await c.close()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    count = 500 if args.quick else 5000

    work = Path(tempfile.mkdtemp(prefix="infergate-bench-"))
    make_mlp(work / "models" / "mlp" / "1" / "model.onnx", sizes=(64, 128, 10))
    redis = RedisProcess(work / "redis-server").start()
    servers: dict[str, ServerProcess] = {}
    try:
        for name, cluster in (("local", ""), ("redis", f'[cluster]\nredis_url = "{redis.url}"\n')):
            folder = work / name
            folder.mkdir()
            (folder / "profile.toml").write_text(cluster + LIMITS)
            servers[name] = ServerProcess(
                work / "models", folder / "profile.toml", folder / "server.log"
            ).start()
        latencies = asyncio.run(measure({n: s.url for n, s in servers.items()}, count))
    finally:
        for server in servers.values():
            server.stop()
        redis.kill()

    figures = {
        name: {"p50_ms": percentile(v, 0.5), "p99_ms": percentile(v, 0.99), "requests": len(v)}
        for name, v in latencies.items()
    }
    added = {
        "added_p50_ms": figures["redis"]["p50_ms"] - figures["local"]["p50_ms"],
        "added_p99_ms": figures["redis"]["p99_ms"] - figures["local"]["p99_ms"],
    }
    if args.json:
        print(orjson.dumps({**figures, **added}, option=orjson.OPT_INDENT_2).decode())
        return
    print(f"{'limits':8} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for name, f in figures.items():
        print(f"{name:8} {f['requests']:8.0f} {f['p50_ms']:8.3f} {f['p99_ms']:8.3f}")
    print(
        f"\nadded by Redis at concurrency 1: p50 {added['added_p50_ms']:.3f} ms, "
        f"p99 {added['added_p99_ms']:.3f} ms (goal: p99 under 1 ms)"
    )


if __name__ == "__main__":
    main()
