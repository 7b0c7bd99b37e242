"""Does a second gateway process pay on this machine? (issue 16: "whether a second gateway
process (SO_REUSEPORT) pays on 2 cores").

One `infergate serve` with two instances of the tiny MLP 64->128->10 (one intra-op
thread each, batching 32 / 5 ms) against two `infergate serve` processes with one instance
each, the Triton comparison's tiny c=64 workload: JSON V2 bodies, 64 keep-alive clients of
infergate's load generator, split 32 and 32 between the two processes, which is what the
kernel's SO_REUSEPORT hashing of connections would do on one port. So the measurement needs
no change to the server: it prices the idea before anyone builds it. Both set-ups run at
once and are measured alternately, the order flipped each round; the figure to trust on a
shared machine is the median of the rounds' ratios (two processes over one).

    .venv/bin/python benchmarks/second_process.py [--rounds 16] [--seconds 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.http_cpu import PATH, PROFILE  # noqa: E402  (the tiny c=64 workload's)
from infergate.loadgen import LoadResult, prepare, run_concurrency  # noqa: E402
from infergate.loadgen import run as run_load  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

CLIENTS = 64


@dataclass(frozen=True)
class Round:
    one_rps: float
    two_rps: float
    one_cpu_us: float  # gateway CPU per request (the serve processes, not their workers)
    two_cpu_us: float
    ratio: float  # two_rps / one_rps


def _models(root: Path, instances: int) -> Path:
    models = root / f"models-{instances}"
    make_mlp(models / "tiny" / "1" / "model.onnx", sizes=(64, 128, 10))
    (models / "tiny" / "model.toml").write_text(
        f"instances = {instances}\nthreads = 1\n[batching]\nmax_batch_size = 32\n"
        "max_queue_delay_ms = 5\n"
    )
    return models


def _cpu_s(servers: list[ServerProcess]) -> float:
    total = 0.0
    for server in servers:
        assert server.process is not None
        times = psutil.Process(server.process.pid).cpu_times()
        total += times.user + times.system
    return total


async def _load(
    servers: list[ServerProcess], body: bytes, headers: dict[str, str], s: float
) -> int:
    """Successful requests from CLIENTS clients split evenly over `servers` for `s` seconds."""
    share = CLIENTS // len(servers)
    results: list[LoadResult] = await asyncio.gather(
        *(run_concurrency(server.url, PATH, body, headers, share, s) for server in servers)
    )
    for result in results:
        if result.failed:
            raise RuntimeError(f"requests failed: {result.failures}")
    return sum(result.ok for result in results)


def _measure(
    servers: list[ServerProcess], body: bytes, headers: dict[str, str], seconds: float
) -> tuple[float, float]:
    """(requests/s, gateway CPU µs per request), after a warm-up of half a second."""
    run_load(_load(servers, body, headers, 0.5))
    before = _cpu_s(servers)
    ok = run_load(_load(servers, body, headers, seconds))
    return ok / seconds, (_cpu_s(servers) - before) * 1e6 / ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--quick", action="store_true", help="two rounds of 1 s")
    parser.add_argument("--json", action="store_true", help="every round, as JSON")
    args = parser.parse_args()
    rounds, seconds = (2, 1.0) if args.quick else (args.rounds, args.seconds)
    work = Path(tempfile.mkdtemp(prefix="infergate-second-"))
    profile = work / "profile.toml"
    profile.write_text(PROFILE)
    one = [ServerProcess(_models(work, 2), profile, work / "one.log")]
    two = [ServerProcess(_models(work, 1), profile, work / f"two-{i}.log") for i in range(2)]
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    body, headers = prepare({"x": x}, binary=False)
    load_start = os.getloadavg()[0]
    measured: list[Round] = []
    try:
        for server in one + two:
            server.start()
        for i in range(rounds):
            if i % 2 == 0:
                one_rps, one_cpu = _measure(one, body, headers, seconds)
                two_rps, two_cpu = _measure(two, body, headers, seconds)
            else:
                two_rps, two_cpu = _measure(two, body, headers, seconds)
                one_rps, one_cpu = _measure(one, body, headers, seconds)
            measured.append(Round(one_rps, two_rps, one_cpu, two_cpu, two_rps / one_rps))
            if not args.json:
                r = measured[-1]
                print(
                    f"round {i + 1}: one process {r.one_rps:,.0f} req/s ({r.one_cpu_us:.0f} µs "
                    f"CPU/request), two {r.two_rps:,.0f} req/s ({r.two_cpu_us:.0f} µs), "
                    f"ratio {r.ratio:.2f}",
                    flush=True,
                )
    finally:
        for server in one + two:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(field: str) -> float:
        return float(statistics.median(float(getattr(r, field)) for r in measured))

    summary = {
        "rounds": [asdict(r) for r in measured],
        "median_ratio": med("ratio"),
        "median_one_rps": med("one_rps"),
        "median_two_rps": med("two_rps"),
        "median_one_cpu_us": med("one_cpu_us"),
        "median_two_cpu_us": med("two_cpu_us"),
        "load_average": [load_start, os.getloadavg()[0]],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"two processes / one: median ratio {summary['median_ratio']:.2f} over {rounds} rounds "
        f"({summary['median_one_rps']:,.0f} -> {summary['median_two_rps']:,.0f} req/s; gateway "
        f"CPU {summary['median_one_cpu_us']:.0f} -> {summary['median_two_cpu_us']:.0f} µs a "
        f"request); load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
