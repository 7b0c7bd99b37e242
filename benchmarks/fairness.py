"""Fair sharing of one model's queue between tenants of the same class.

One worker, batching off, a scripted model that takes `sleep_ms` per request (a sleep, not
CPU work, so the figures mean the same on a faster or busier machine). A light tenant
sends one stream of requests (closed loop, concurrency 1); a flooding tenant sends many.
The light tenant's latency is measured three ways:

- alone: nothing else runs;
- fair: the flooder is another tenant of the same class (what fair queuing gives);
- shared: the light stream sends with the flooder's own key, so the two are one tenant
  and the queue serves them in arrival order (what every tenant got before fair queuing):
  the light request waits behind the flooder's whole backlog.

    .venv/bin/python benchmarks/fairness.py [--quick] [--json] [--flood N] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.engine.admission.tenants import hash_key  # noqa: E402
from infergate.engine.runtimes import PLUGINS_ENV  # noqa: E402
from infergate.loadgen import LoadResult, prepare, run_concurrency  # noqa: E402
from infergate.loadgen import run as run_load  # noqa: E402
from tests.scripted_runtime import PLUGIN, make_scripted  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

LIGHT, FLOOD = "light-key", "flood-key"
PROFILE = f"""
[server]
[batching]
max_queue_size = 4096
[tenants.light]
class = "batch"
api_keys = ["{hash_key(LIGHT)}"]
[tenants.flood]
class = "batch"
api_keys = ["{hash_key(FLOOD)}"]
"""  # class "batch": a 30 s deadline, so queued requests wait instead of expiring


async def _measure(
    url: str, body: bytes, headers: dict[str, str], light_key: str, flood: int, seconds: float
) -> tuple[LoadResult, LoadResult | None]:
    path = "/v2/models/sleepy/infer"

    def keyed(key: str) -> dict[str, str]:
        return {**headers, "Authorization": f"Bearer {key}"}

    light = run_concurrency(url, path, body, keyed(light_key), 1, seconds)
    if flood == 0:
        return await light, None
    flooder = run_concurrency(url, path, body, keyed(FLOOD), flood, seconds + 0.5)
    flood_task = asyncio.ensure_future(flooder)
    await asyncio.sleep(0.5)  # the flooder's backlog builds up first
    light_result = await light
    return light_result, await flood_task


def _row(result: LoadResult) -> dict[str, Any]:
    return {
        "requests": result.requests,
        "p50_ms": round(result.p50_ms, 1),
        "p99_ms": round(result.p99_ms, 1),
        "errors": result.errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short pass (CI)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--flood", type=int, default=8, help="the flooder's streams")
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--sleep-ms", type=int, default=10, help="the model's time per request")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else args.seconds
    os.environ[PLUGINS_ENV] = PLUGIN
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = root / "models"
        make_scripted(models / "sleepy" / "1" / "model.scripted", controls=("sleep_ms",))
        (models / "sleepy" / "model.toml").write_text("[batching]\nmax_batch_size = 0\n")
        (root / "profile.toml").write_text(PROFILE)
        # The server and its workers import the scripted runtime from this checkout.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        server = ServerProcess(
            models, root / "profile.toml", root / "server.log", env={"PYTHONPATH": path}
        ).start()
        try:
            x = np.zeros((1, 4), np.float32)
            sleep = np.full((1, 1), args.sleep_ms, np.int64)
            body, headers = prepare({"x": x, "sleep_ms": sleep}, binary=True)
            figures: dict[str, Any] = {"flood_streams": args.flood, "sleep_ms": args.sleep_ms}
            for name, key, flood in (
                ("alone", LIGHT, 0),
                ("fair", LIGHT, args.flood),
                ("shared", FLOOD, args.flood),
            ):
                light, flooder = run_load(_measure(server.url, body, headers, key, flood, seconds))
                figures[name] = {"light": _row(light)}
                if flooder is not None:
                    figures[name]["flood"] = _row(flooder)
        finally:
            server.stop()
    if args.json:
        print(orjson.dumps(figures, option=orjson.OPT_INDENT_2).decode())
        return
    print(f"one worker, {args.sleep_ms} ms per request; flooder: {args.flood} streams")
    for name in ("alone", "fair", "shared"):
        light = figures[name]["light"]
        print(
            f"  {name:7s} light tenant p50 {light['p50_ms']:7.1f} ms  p99 {light['p99_ms']:7.1f} ms"
            f"  ({light['requests']} requests, errors {light['errors'] or 'none'})"
        )


if __name__ == "__main__":
    main()
