"""The gateway's CPU per request over real HTTP, at the tiny model and concurrency 64.

    .venv/bin/python benchmarks/http_cpu.py [--quick] [--requests N] [--rounds R] [--json]
        [--tree NAME=PATH ...] [--fronts N] [--granian DIR]

On a shared machine, requests/s measures the neighbours as much as the server; the CPU a
request costs the server does not (much). So this starts a real `infergate serve` (uvicorn,
our edge-limit protocol, sockets: everything `benchmarks/gateway_cpu.py` leaves out), sends
it N requests from 64 keep-alive connections (infergate's raw client, in this process: its
CPU is not counted) and reads the utime + stime of the gateway process and of its model
workers from /proc before and after. The model is the MLP 64→128→10 with JSON tensors both
ways, two one-thread instances, batching up to 32 rows or 5 ms: `benchmarks/triton_peer.py`'s
tiny c=64 workload. Each figure is the median of the rounds.

`--tree NAME=PATH` (repeatable) runs the code of another checkout beside this one, measured
in alternation, the order flipped each round: the way to measure a change on a busy host.
`--fronts N` also serves this tree with `[server] fronts = N` (its HTTP in N front
processes beside the engine's, server/fronts.py), measured in the same alternation; its
gateway figure is the engine and its fronts together.
`--bare` runs the HTTP servers alone, answering a fixed body: their own CPU per request.
`--c1` measures a lone client instead (concurrency 1, the same model and body): its p50
latency, and the server's own split of it from the model's Triton statistics (the time in
the queue, and "compute": from leaving the queue to the worker's reply being read, so the
pipe both ways and the worker's run), per request; p50 ratios are taken round by round.
`--granian DIR` also serves this tree's app with granian (ASGI, one worker) installed under
DIR (`pip install --target DIR granian`), to price the HTTP server layer; granian's
gateway figure is its worker process plus its supervisor.

This script measures and reports; the servers it measures beside infergate's own
(granian, and `--bare`'s) start and stop in `benchmarks/http_cpu_servers.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.http_cpu_servers import start_bare, start_granian, stop_granian  # noqa: E402
from infergate.loadgen import prepare  # noqa: E402
from infergate.rawhttp import RawConnection  # noqa: E402
from infergate.server_split import parse_split  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

PATH = "/v2/models/tiny/infer"
PROFILE = """
[tenants.default]
class = "batch"
rps = 1000000
burst = 1000000
max_concurrency = 10000
"""
MODEL_TOML = "instances = 2\nthreads = 1\n[batching]\nmax_batch_size = 32\nmax_queue_delay_ms = 5\n"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5)


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            found += kids
            todo += kids
    return found


@dataclass(frozen=True)
class Served:
    name: str
    url: str
    root: int  # the process started; the gateway is it and every descendant but workers
    workers: list[int]


def snapshot(server: Served) -> tuple[float, float]:
    """CPU seconds of (the gateway's processes, the model workers and their children)."""
    workers = set(server.workers)
    for pid in server.workers:
        workers.update(descendants(pid))
    every = [server.root, *descendants(server.root)]
    gateway = sum(cpu_s(p) for p in every if p not in workers)
    return gateway, sum(cpu_s(p) for p in workers)


async def drive(url: str, body: bytes, headers: dict[str, str], n: int, c: int) -> None:
    conns = [await RawConnection.open(url) for _ in range(c)]
    prepared = conns[0].request_bytes("POST", PATH, body, headers)
    bad: list[int] = []

    async def client(conn: RawConnection, count: int) -> None:
        for _ in range(count):
            response = await conn.send(prepared)
            if response.status != 200:
                bad.append(response.status)

    try:
        await asyncio.gather(*(client(conn, n // c + (i < n % c)) for i, conn in enumerate(conns)))
    finally:
        for conn in conns:
            await conn.close()
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {sorted(set(bad))}")


def measure(server: Served, body: bytes, headers: dict[str, str], n: int, c: int) -> list[float]:
    """CPU µs per request of the gateway's processes and of the workers, requests/s, and
    the CPU µs of the process started alone (with fronts: the engine's, whose one loop
    is then the limit where cores are to spare)."""
    gateway, workers = snapshot(server)
    root = cpu_s(server.root)
    started = time.perf_counter()
    uvloop.run(drive(server.url, body, headers, n, c))
    wall = time.perf_counter() - started
    gateway_after, workers_after = snapshot(server)
    return [
        (gateway_after - gateway) / n * 1e6,
        (workers_after - workers) / n * 1e6,
        n / wall,
        (cpu_s(server.root) - root) / n * 1e6,
    ]


async def lone_client(url: str, body: bytes, headers: dict[str, str], n: int) -> list[float]:
    """Latencies of `n` requests sent one after another on one connection."""
    conn = await RawConnection.open(url)
    prepared = conn.request_bytes("POST", PATH, body, headers)
    latencies = []
    try:
        for _ in range(n):
            started = time.perf_counter()
            response = await conn.send(prepared)
            latencies.append(time.perf_counter() - started)
            if response.status != 200:
                raise RuntimeError(f"a request failed: {response.status}")
    finally:
        await conn.close()
    return latencies


def measure_c1(server: Served, body: bytes, headers: dict[str, str], n: int) -> list[float]:
    """p50 µs at c=1, the server's queue and compute µs per request, gateway CPU µs."""
    stats = f"{server.url}/v2/models/tiny/stats"
    before = parse_split(httpx.get(stats, timeout=10).content)
    gateway, _ = snapshot(server)
    latencies = uvloop.run(lone_client(server.url, body, headers, n))
    gateway_after, _ = snapshot(server)
    after = parse_split(httpx.get(stats, timeout=10).content)
    q_s, q_n, c_s, c_n = (a - b for a, b in zip(after, before, strict=True))
    return [
        statistics.median(latencies) * 1e6,
        q_s / q_n * 1e6 if q_n else 0.0,
        c_s / c_n * 1e6 if c_n else 0.0,
        (gateway_after - gateway) / n * 1e6,
    ]


def report_c1(cells: dict[str, list[list[float]]], rounds: int, n: int, as_json: bool) -> None:
    report: dict[str, Any] = {
        name: {
            "p50_us": round(statistics.median(r[0] for r in rows), 1),
            "server_queue_us": round(statistics.median(r[1] for r in rows), 1),
            "server_compute_us": round(statistics.median(r[2] for r in rows), 1),
            "gateway_cpu_us_per_request": round(statistics.median(r[3] for r in rows), 1),
            "p50_us_each_round": [round(r[0], 1) for r in rows],
        }
        for name, rows in cells.items()
    }
    first = cells[next(iter(cells))]
    for name, rows in list(cells.items())[1:]:
        ratios = [r[0] / f[0] for r, f in zip(rows, first, strict=True) if f[0]]
        report[name]["p50_ratio_to_first"] = round(statistics.median(ratios), 3)
    if as_json:
        print(orjson.dumps({**report, "load_average": os.getloadavg()[0]}).decode())
        return
    print(
        f"tiny MLP, JSON, c=1: median of {rounds} rounds of {n} requests "
        f"(load average {os.getloadavg()[0]:.1f})"
    )
    for name, row in report.items():
        print(
            f"  {name:10s} p50 {row['p50_us']:6.1f} µs  server: queue {row['server_queue_us']:5.1f}"
            f"  compute {row['server_compute_us']:6.1f}  gateway CPU "
            f"{row['gateway_cpu_us_per_request']:6.1f} µs/request  (p50 rounds "
            f"{row['p50_us_each_round']})"
        )
        if "p50_ratio_to_first" in row:
            print(
                f"  {'':10s} p50 / {next(iter(cells))}'s, median of the rounds' ratios: "
                f"{row['p50_ratio_to_first']}"
            )


def worker_pids(url: str) -> list[int]:
    doc = httpx.get(f"{url}/admin/models/tiny", timeout=10).json()
    return [i["pid"] for v in doc["versions"] for i in v["instances"] if i["pid"] is not None]


def tiny_setup(work: Path) -> tuple[Path, Path, bytes, dict[str, str]]:
    """The tiny model's repository and profile under `work` (made the working directory:
    `python -m` puts it first on the path, and it holds no code), and one request's body
    and headers: what every measurement here serves."""
    models = work / "models"
    make_mlp(models / "tiny" / "1" / "model.onnx", sizes=(64, 128, 10))
    (models / "tiny" / "model.toml").write_text(MODEL_TOML)
    profile = work / "profile.toml"
    profile.write_text(PROFILE)
    os.chdir(work)
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    body, headers = prepare({"x": x}, binary=False)
    return models, profile, body, headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH; default: this")
    parser.add_argument("--granian", type=Path, help="a folder holding granian: measure it too")
    parser.add_argument(
        "--bare", action="store_true", help="the HTTP servers alone (no gateway): their own cost"
    )
    parser.add_argument(
        "--c1", action="store_true", help="a lone client: p50 latency and the server's split"
    )
    parser.add_argument(
        "--fronts", type=int, default=0, help="also serve with [server] fronts = N (this tree)"
    )
    parser.add_argument("--requests", type=int, default=40_000, help="per round and server")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 5_000, 1
    if args.c1:
        args.bare, args.granian = False, None
        args.requests = min(args.requests, 1_000 if args.quick else 4_000)
    trees = dict(t.split("=", 1) for t in args.tree)
    if not any(Path(tree).resolve() == ROOT.resolve() for tree in trees.values()):
        trees["this"] = str(ROOT)  # always beside the others (`--tree before=PATH` alone
        # measured the other tree only)
    work = Path(tempfile.mkdtemp(prefix="infergate-httpcpu-"))
    models, profile, body, headers = tiny_setup(work)
    servers: dict[str, Served] = {}
    stops: list[Callable[[], None]] = []
    try:
        for name, tree in ({} if args.bare else trees).items():
            env = {"PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
            sp = ServerProcess(models, profile, work / f"{name}.log", env=env).start()
            stops.append(sp.stop)
            assert sp.process is not None
            servers[name] = Served(name, sp.url, sp.process.pid, worker_pids(sp.url))
        if args.fronts and not args.bare:  # this tree again, its HTTP in front processes
            split = work / "profile-fronts.toml"
            split.write_text(f"{PROFILE}\n[server]\nfronts = {args.fronts}\n")
            name = f"fronts={args.fronts}"
            sp = ServerProcess(models, split, work / "fronts.log").start()
            stops.append(sp.stop)
            assert sp.process is not None
            servers[name] = Served(name, sp.url, sp.process.pid, worker_pids(sp.url))
        if args.granian and not args.bare:
            gp, url = start_granian(work, models, profile, args.granian)
            stops.append(partial(stop_granian, gp))
            servers["granian"] = Served("granian", url, gp.pid, worker_pids(url))
        if args.bare:
            for name, (process, url) in start_bare(work, args.granian).items():
                stops.append(partial(stop_granian, process))
                servers[name] = Served(name, url, process.pid, [])
        for server in servers.values():  # warm up: imports, first batches, the JIT-free path
            measure(server, body, headers, min(args.requests, 5_000), args.concurrency)
        cells: dict[str, list[list[float]]] = {name: [] for name in servers}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                if args.c1:
                    got = measure_c1(servers[name], body, headers, args.requests)
                else:
                    got = measure(servers[name], body, headers, args.requests, args.concurrency)
                cells[name].append(got)
    finally:
        for stop in reversed(stops):
            stop()
    if args.c1:
        report_c1(cells, args.rounds, args.requests, args.json)
        return
    report: dict[str, Any] = {
        name: {
            "gateway_cpu_us_per_request": round(statistics.median(r[0] for r in rows), 1),
            "workers_cpu_us_per_request": round(statistics.median(r[1] for r in rows), 1),
            "requests_per_s": round(statistics.median(r[2] for r in rows)),
            "gateway_cpu_us_each_round": [round(r[0], 1) for r in rows],
            "engine_process_cpu_us_per_request": round(statistics.median(r[3] for r in rows), 1),
        }
        for name, rows in cells.items()
    }
    first = cells[next(iter(cells))]
    for name, rows in list(cells.items())[1:]:  # round by round: the host drifts between
        ratios = [r[0] / f[0] for r, f in zip(rows, first, strict=True) if f[0]]
        report[name]["gateway_cpu_ratio_to_first"] = round(statistics.median(ratios), 3)
        rates = [r[2] / f[2] for r, f in zip(rows, first, strict=True) if f[2]]
        report[name]["requests_per_s_ratio_to_first"] = round(statistics.median(rates), 3)
    report["load_average"] = os.getloadavg()[0]
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    print(
        f"tiny MLP, JSON, c={args.concurrency}: CPU µs per request, median of {args.rounds} "
        f"rounds of {args.requests} requests (load average {os.getloadavg()[0]:.1f})"
    )
    for name, row in report.items():
        if name == "load_average":
            continue
        assert isinstance(row, dict)
        print(
            f"  {name:10s} gateway {row['gateway_cpu_us_per_request']:6.1f}  workers "
            f"{row['workers_cpu_us_per_request']:6.1f}  ({row['requests_per_s']} req/s; "
            f"rounds {row['gateway_cpu_us_each_round']})"
        )
        if name.startswith("fronts="):
            print(
                f"  {'':10s} of which the engine's process "
                f"{row['engine_process_cpu_us_per_request']}"
            )
        if "gateway_cpu_ratio_to_first" in row:
            print(
                f"  {'':10s} gateway CPU / {next(iter(cells))}'s, median of the rounds' "
                f"ratios: {row['gateway_cpu_ratio_to_first']}; requests/s: "
                f"{row['requests_per_s_ratio_to_first']}"
            )


if __name__ == "__main__":
    main()
