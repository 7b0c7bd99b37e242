"""The gateway's own CPU per request: the infer route driven in-process, without HTTP.

    .venv/bin/python benchmarks/gateway_cpu.py [--tiny] [--quick] [--json] [--profile FILE]

End-to-end figures on a shared 2-core machine move by 10-20% from run to run, because the
load generator, uvicorn and the workers all compete for the cores. This one measures only
the Python path a request takes through the gateway (route, decode, admission, breaker,
scheduler, batching, the pipe to real worker processes, encode), as CPU time of the
gateway's thread, so a change to that path shows in a few seconds to within a few percent.

The model takes and returns rows as large as the batching benchmark's (1024 in, 1000 out)
but computes almost nothing, as binary tensors; 64 callers on two single-thread instances,
batching on. `--tiny` serves the other benchmarks' MLP 64→128→10 with JSON tensors both
ways instead, the small request most gateways carry.
`--profile FILE` also writes a cProfile of the measured part (wall clock, so functions that
wake workers look dearer than they are).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.engine.engine import Engine  # noqa: E402
from infergate.loadgen import prepare  # noqa: E402
from infergate.profile import load_profile  # noqa: E402
from infergate.server.gateway import build_gateway  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402

CONCURRENCY = 64


async def _wait_ready(engine: Engine, model: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (engine.ready and engine.model(model).state == "ready"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"model {model!r} did not load: {engine.model(model).reason}")
        await asyncio.sleep(0.05)


async def measure(seconds: float, profile_to: Path | None, tiny: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="infergate-gwcpu-"))
    models = work / "models"
    sizes = (64, 128, 10) if tiny else (1024, 64, 1000)
    make_mlp(models / "m" / "1" / "model.onnx", sizes=sizes)
    (models / "m" / "model.toml").write_text(
        "instances = 2\nthreads = 1\n[batching]\nmax_batch_size = 64\n"
    )
    profile_file = work / "profile.toml"
    profile_file.write_text(
        '[tenants.default]\nclass = "batch"\nrps = 1000000\nburst = 1000000\n'
        "max_concurrency = 10000\n"
    )
    engine, app, _ = build_gateway(load_profile(profile_file), models)
    await engine.start()
    try:
        await _wait_ready(engine, "m")
        x = np.random.default_rng(1).standard_normal((1, sizes[0])).astype(np.float32)
        body, headers = prepare({"x": x}, binary=not tiny)
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v2/models/m/infer",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
            + [(b"content-length", str(len(body)).encode())],
        }
        message = {"type": "http.request", "body": body, "more_body": False}
        done = 0

        async def receive() -> dict[str, Any]:
            return message

        async def caller(until: float) -> None:
            nonlocal done
            statuses: list[int] = []

            async def send(event: dict[str, Any]) -> None:
                if event["type"] == "http.response.start":
                    statuses.append(event["status"])

            while time.perf_counter() < until:
                await app(dict(scope), receive, send)  # type: ignore[arg-type]
                done += 1
            if any(s != 200 for s in statuses):
                raise RuntimeError(f"requests failed with {sorted(set(statuses))}")

        warm_until = time.perf_counter() + min(1.0, seconds)
        await asyncio.gather(*(caller(warm_until) for _ in range(CONCURRENCY)))
        gc.freeze()  # as `infergate serve` does (cli/serve.py)
        gc.set_threshold(50_000, 20, 10)
        profiler = cProfile.Profile() if profile_to else None
        done = 0
        cpu, wall = time.thread_time(), time.perf_counter()
        if profiler:
            profiler.enable()
        await asyncio.gather(*(caller(wall + seconds) for _ in range(CONCURRENCY)))
        if profiler:
            profiler.disable()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        if profiler and profile_to:
            profiler.dump_stats(profile_to)
    finally:
        await engine.stop()
    return {
        "requests": done,
        "requests_per_s": round(done / wall),
        "gateway_cpu_us_per_request": round(cpu / done * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="the MLP 64→128→10 with JSON tensors both ways"
    )
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the measured part")
    args = parser.parse_args()
    report = uvloop.run(measure(1.0 if args.quick else 5.0, args.profile, args.tiny))
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    for key, value in report.items():
        print(f"{key:28} {value}")


if __name__ == "__main__":
    main()
