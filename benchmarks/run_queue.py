"""Who runs and who waits for a core, process by process, under the tiny c=64 load.

    .venv/bin/python benchmarks/run_queue.py [--fronts N] [--worker-nice N] [--rounds R]
        [--requests N] [--quick] [--json]

requests/s and CPU per request say how fast the gateway is, not why it is not faster. On a
machine with few cores, a process can be held up with nothing to do (waiting for another
to hand it work) or ready to run with no core free for it (the run queue). The kernel
counts both for every thread (`/proc/PID/task/TID/schedstat`: time on a core, time
waiting in the run queue), so this serves `http_cpu.py`'s workload (the tiny MLP, JSON
both ways, two one-thread instances, batching 32 / 5 ms, 64 keep-alive connections of
infergate's raw client in this process) and prints, per round, for the engine's process,
each front (`--fronts`), each worker and the load generator: the cores it used, the
seconds per second it spent ready but waiting for a core, and that wait per switch onto
a core; and the machine's busy cores (`/proc/stat`). A process whose run and wait add up
to about 1 is the bottleneck; one far below that is starved by the others. `--worker-nice`
serves with `[devices] worker_nice` set (10 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from http_cpu import PROFILE, Served, descendants, measure, tiny_setup, worker_pids  # noqa: E402

from tests.server import ServerProcess  # noqa: E402

FRONT_NAME = "ig-front"  # server/front.py names its process so


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def schedstat(pid: int) -> tuple[int, int, int]:
    """ns on a core, ns waiting in the run queue, and switches onto a core, all threads."""
    run = wait = switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            a, b, c = (int(x) for x in (task / "schedstat").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
        run, wait, switches = run + a, wait + b, switches + c
    return run, wait, switches


def busy_jiffies() -> tuple[int, int]:
    """(busy, all) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def one_round(
    server: Served, roles: dict[str, int], body: bytes, headers: dict[str, str], n: int
) -> dict[str, Any]:
    before = {role: schedstat(pid) for role, pid in roles.items()}
    busy, total = busy_jiffies()
    started = time.perf_counter()
    rate = measure(server, body, headers, n, 64)[2]
    wall = time.perf_counter() - started
    busy_after, total_after = busy_jiffies()
    cores = os.cpu_count() or 1
    row: dict[str, Any] = {
        "requests_per_s": round(rate),
        "machine_busy_cores": round(cores * (busy_after - busy) / max(1, total_after - total), 2),
    }
    for role, pid in roles.items():
        a, b = before[role], schedstat(pid)
        run, wait, switches = (y - x for x, y in zip(a, b, strict=True))
        row[role] = {
            "cores": round(run / 1e9 / wall, 2),
            "run_queue_s_per_s": round(wait / 1e9 / wall, 2),
            "wait_us_per_switch": round(wait / max(1, switches) / 1e3, 1),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fronts", type=int, default=0, help="[server] fronts")
    parser.add_argument("--worker-nice", type=int, default=10, help="[devices] worker_nice")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30_000, help="per round")
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 1, 5_000
    work = Path(tempfile.mkdtemp(prefix="infergate-runqueue-"))
    models, profile, body, headers = tiny_setup(work)
    profile.write_text(
        f"{PROFILE}\n[server]\nfronts = {args.fronts}\n"
        f"[devices]\nworker_nice = {args.worker_nice}\n"
    )
    process = ServerProcess(models, profile, work / "gateway.log").start()
    try:
        assert process.process is not None
        root = process.process.pid
        workers = worker_pids(process.url)
        server = Served("this", process.url, root, workers)
        measure(server, body, headers, 5_000, 64)  # warm up
        fronts = [p for p in descendants(root) if _name(p) == FRONT_NAME]
        roles = {"engine": root, "load generator": os.getpid()}
        roles.update({f"front {i}": pid for i, pid in enumerate(fronts)})
        roles.update({f"worker {i}": pid for i, pid in enumerate(workers)})
        rows = [one_round(server, roles, body, headers, args.requests) for _ in range(args.rounds)]
    finally:
        process.stop()
    if args.json:
        print(json.dumps({"fronts": args.fronts, "worker_nice": args.worker_nice, "rounds": rows}))
        return
    print(
        f"tiny MLP, JSON, c=64, fronts={args.fronts}, worker_nice={args.worker_nice}: per round "
        f"of {args.requests} requests, cores used / run-queue wait (s per s, µs per switch)"
    )
    for row in rows:
        print(f"  {row['requests_per_s']} req/s, machine {row['machine_busy_cores']} cores busy")
        for role in roles:
            cell = row[role]
            print(
                f"    {role:15s} {cell['cores']:5.2f} cores  "
                f"waiting {cell['run_queue_s_per_s']:5.2f}"
                f"  ({cell['wait_us_per_switch']:6.1f} µs a switch)"
            )


if __name__ == "__main__":
    main()
