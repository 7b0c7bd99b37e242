"""What limits shared through Redis add to each request: a gateway whose tenant limits
live in Redis ([cluster], a redis-server on loopback) against the same gateway with the
same limits in process, requests sent to the two in turn so both see the same machine.

    .venv/bin/python benchmarks/redis_limits.py [--quick] [--rounds N] [--json]

Every request is checked against a rate and a concurrency limit (never reached): the
cluster gateway waits for one Redis round trip (the admission script) and writes the
lease's release without waiting for it. The requests are sent in rounds; each round gives
p50/p99 at concurrency 1 for both gateways and the added p99, and the figure reported is
the median over the rounds (goal: under 1 ms), so one noisy round does not decide it. Also
reported: the Redis commands per request, from Redis's own INFO commandstats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.client import encode_infer_request  # noqa: E402
from infergate.engine.cluster import scripts  # noqa: E402
from infergate.rawhttp import RawConnection  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.redis_server import RedisProcess  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

LIMITS = "[tenants.default]\nrps = 1000000\nburst = 1000000\nmax_concurrency = 10000\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


# INFO commandstats counts the commands the Lua scripts run as well; these are theirs (the
# gateway sends none of them itself), reported apart from the commands a gateway sends.
IN_SCRIPTS = frozenset(
    name.lower() for name in re.findall(r"redis\.call\('(\w+)'", scripts.ADMIT + scripts.RENEW)
)


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls of each command Redis has run so far (INFO commandstats)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user and system) each process has used so far."""
    times = {name: psutil.Process(pid).cpu_times() for name, pid in pids.items()}
    return {name: t.user + t.system for name, t in times.items()}


@dataclass
class Measured:
    rounds: list[dict[str, list[float]]]  # each round's latencies, by gateway
    commands: dict[str, int]  # the Redis commands run during the rounds, by name
    cpu_s: dict[str, float]  # CPU time used during the rounds, by process


async def measure(
    urls: dict[str, str], pids: dict[str, int], rounds: int, count: int, redis_process: RedisProcess
) -> Measured:
    """`rounds` rounds of `count` requests to each gateway in turn, after 100 to warm up,
    with what Redis and each process (`pids`) did meanwhile."""
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    body, headers = encode_infer_request({"x": x}, binary=True)
    conns = {name: await RawConnection.open(url) for name, url in urls.items()}
    prepared = {
        name: c.request_bytes("POST", "/v2/models/mlp/infer", body, headers)
        for name, c in conns.items()
    }

    async def one_round(n: int) -> dict[str, list[float]]:
        latencies: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(n):
            for name, conn in conns.items():
                t0 = time.perf_counter()
                response = await conn.send(prepared[name])
                if response.status != 200:
                    raise RuntimeError(f"{name}: {response.status} {response.body[:200]!r}")
                latencies[name].append(time.perf_counter() - t0)
        return latencies

    await one_round(100)
    stats = redis_process.client()  # one connection, opened before the first count
    before, cpu_before = command_calls(stats), cpu_seconds(pids)
    results = [await one_round(count) for _ in range(rounds)]
    after, cpu_after = command_calls(stats), cpu_seconds(pids)
    for c in conns.values():
        await c.close()
    commands = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    commands.pop("info", None)  # ours, not the gateway's
    return Measured(results, commands, {k: cpu_after[k] - cpu_before[k] for k in pids})


def summarize(latencies: dict[str, list[float]]) -> dict[str, float]:
    figures = {
        f"{name}_{q}_ms": percentile(v, p)
        for name, v in latencies.items()
        for q, p in (("p50", 0.5), ("p99", 0.99))
    }
    figures["added_p50_ms"] = figures["redis_p50_ms"] - figures["local_p50_ms"]
    figures["added_p99_ms"] = figures["redis_p99_ms"] - figures["local_p99_ms"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 5, quick 3)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    count = 300 if args.quick else 2000

    load_start = os.getloadavg()[0]  # the machine's business, beside the figures
    work = Path(tempfile.mkdtemp(prefix="infergate-bench-"))
    make_mlp(work / "models" / "mlp" / "1" / "model.onnx", sizes=(64, 128, 10))
    redis_process = RedisProcess(work / "redis-server").start()
    servers: dict[str, ServerProcess] = {}
    try:
        for name, cluster in (
            ("local", ""),
            ("redis", f'[cluster]\nredis_url = "{redis_process.url}"\n'),
        ):
            folder = work / name
            folder.mkdir()
            (folder / "profile.toml").write_text(cluster + LIMITS)
            servers[name] = ServerProcess(
                work / "models", folder / "profile.toml", folder / "server.log"
            ).start()
        pids = {n: s.process.pid for n, s in servers.items() if s.process is not None}
        assert redis_process.process is not None
        pids["redis-server"] = redis_process.process.pid
        measured = asyncio.run(
            measure({n: s.url for n, s in servers.items()}, pids, rounds, count, redis_process)
        )
    finally:
        for server in servers.values():
            server.stop()
        redis_process.kill()

    load = os.getloadavg()[0]
    per_round = [summarize(r) for r in measured.rounds]
    commands = measured.commands
    requests = rounds * count
    median = {k: statistics.median(f[k] for f in per_round) for k in per_round[0]}
    sent = {k: n / requests for k, n in sorted(commands.items()) if k not in IN_SCRIPTS}
    report: dict[str, Any] = {
        "rounds": per_round,
        "median": median,
        "requests_per_round": count,
        "redis_commands_per_request": sum(sent.values()),
        "redis_commands": sent,
        "load_average_1m": {"start": load_start, "end": load},
        # CPU time per request of each gateway process (its workers aside) and of Redis:
        # unlike the latencies, barely moved by what else runs on the machine.
        "cpu_us_per_request": {k: v / requests * 1e6 for k, v in measured.cpu_s.items()},
        "run_by_scripts_per_request": sum(n for k, n in commands.items() if k in IN_SCRIPTS)
        / requests,
    }
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    print(
        f"{rounds} rounds of {count} requests to each gateway, concurrency 1 "
        f"(load average {load_start:.1f} at the start, {load:.1f} at the end)"
    )
    print(
        f"{'round':>5} {'local p50':>10} {'p99':>7} {'redis p50':>10} {'p99':>7} "
        f"{'added p50':>10} {'p99':>7}  (ms)"
    )
    for i, f in enumerate([*per_round, median]):
        label = "median" if i == len(per_round) else str(i + 1)
        print(
            f"{label:>6} {f['local_p50_ms']:9.3f} {f['local_p99_ms']:7.3f} "
            f"{f['redis_p50_ms']:10.3f} {f['redis_p99_ms']:7.3f} "
            f"{f['added_p50_ms']:10.3f} {f['added_p99_ms']:7.3f}"
        )
    breakdown = ", ".join(
        f"{k} {v:.2f}" if v >= 0.01 else f"{k} {round(v * requests)} in {requests}"  # reconnects
        for k, v in report["redis_commands"].items()
    )
    print(
        f"\nadded by Redis at concurrency 1, median of {rounds} rounds: p50 "
        f"{median['added_p50_ms']:.3f} ms, p99 {median['added_p99_ms']:.3f} ms "
        f"(goal: p99 under 1 ms)\nRedis commands per request: "
        f"{report['redis_commands_per_request']:.2f} ({breakdown}), and "
        f"{report['run_by_scripts_per_request']:.2f} run inside the scripts"
    )
    cpu = report["cpu_us_per_request"]
    print(
        f"CPU per request: gateway {cpu['local']:.0f} us in process, {cpu['redis']:.0f} us "
        f"with Redis (added {cpu['redis'] - cpu['local']:.0f} us); redis-server "
        f"{cpu['redis-server']:.0f} us"
    )


if __name__ == "__main__":
    main()
