"""Start-up cost: how long `infergate serve` takes to answer ready with an empty repository
and how much CPU it costs from launch to stop, the same for two CLI commands run as a
process each (as the tests run them), and for one worker loading a tiny model (ONNX, and
TorchScript when torch is installed) from start to ready.

    .venv/bin/python benchmarks/startup.py [--quick] [--json]

CPU is user + system seconds. The gateway's and the commands' count every process they
started (the gateway's helpers included). A worker's figure is the worker process's own CPU at ready
plus what the starting process spent on it; "helpers" is what the gateway's helper
processes (multiprocessing's fork server and resource tracker) spent over all the starts
of one runtime, most of it once per gateway. Later starts are the ones that matter for
reloads and restarts after a crash; the first also pays for starting the helpers.

The workers are started from a `python -c` process, as from `python -m infergate serve`:
multiprocessing has a worker re-import a main *script* (this file) first, which would
count this benchmark's imports in every worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.engine.repository.spec import TensorSpec  # noqa: E402
from infergate.engine.runtimes import unavailable_reason  # noqa: E402
from infergate.engine.workers.handle import WorkerHandle  # noqa: E402
from infergate.engine.workers.messages import WorkerSpec  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import free_port  # noqa: E402


@dataclass
class Row:
    what: str
    starts: int
    first_s: float  # wall time of the first start
    median_s: float  # of the later starts
    median_cpu_s: float  # of the later starts
    helpers_cpu_s: float  # helper processes, over all the starts


def cpu(proc: psutil.Process, children: bool = False) -> float:
    t = proc.cpu_times()
    total = t.user + t.system
    return total + (t.children_user + t.children_system if children else 0.0)


def children_cpu() -> float:
    """CPU of this process's children that have been waited for, and of theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_gateway(empty: Path, profile: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`infergate serve` on an empty repository, once /v2/health/ready answers 200."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "infergate", "serve", "--models", str(empty)]
        + ["--profile", str(profile), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=5) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError("the gateway exited before it was ready")
            try:
                if client.get(f"{url}/v2/health/ready").status_code == 200:
                    return process, url
            except httpx.TransportError:
                pass
            time.sleep(0.005)


def gateway(runs: int, work: Path) -> Row:
    """`infergate serve` on an empty repository, from launch to ready to stopped: the
    CPU of the gateway and every process it started (reaped, so counted in its
    children's), the way a test that starts a server pays for it."""
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    profile = work / "profile.toml"
    profile.write_text("")
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(runs):
        before = children_cpu()
        started = time.perf_counter()
        process, _ = start_gateway(empty, profile)
        try:
            walls.append(time.perf_counter() - started)
            process.send_signal(signal.SIGINT)
            process.wait(30)
        finally:
            if process.poll() is None:  # not stopped in time, or interrupted: no leftovers
                process.kill()
                process.wait()
        cpus.append(children_cpu() - before)
    return Row(
        "gateway, empty repository",
        runs,
        walls[0],
        statistics.median(walls[1:] or walls),
        statistics.median(cpus[1:] or cpus),
        0.0,
    )


def cli(runs: int, work: Path) -> list[Row]:
    """CLI commands as the tests run them, a process each: one that prints and exits, and
    one that asks a running gateway."""
    process, url = start_gateway(work / "empty", work / "profile.toml")
    rows = []
    try:
        for what, args in [
            ("infergate --version", ["--version"]),
            ("infergate model list --json", ["model", "list", "--json", "--url", url]),
        ]:
            walls: list[float] = []
            cpus: list[float] = []
            for _ in range(runs):
                before = children_cpu()
                started = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "infergate", *args],
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    check=True,
                    capture_output=True,
                )
                walls.append(time.perf_counter() - started)
                cpus.append(children_cpu() - before)
            rows.append(
                Row(
                    what,
                    runs,
                    walls[0],
                    statistics.median(walls[1:] or walls),
                    statistics.median(cpus[1:] or cpus),
                    0.0,
                )
            )
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    return rows


def helpers_cpu(workers: set[int]) -> float:
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        if child.pid not in workers:
            with contextlib.suppress(psutil.Error):
                total += cpu(child)
    return total


async def workers(what: str, spec: WorkerSpec, runs: int) -> Row:
    walls: list[float] = []
    cpus: list[float] = []
    pids: set[int] = set()
    before = helpers_cpu(pids)
    for _ in range(runs):
        handle = WorkerHandle(spec)
        started, own = time.perf_counter(), time.process_time()
        ready = await handle.start(120)
        walls.append(time.perf_counter() - started)
        pids.add(ready.pid)
        cpus.append(cpu(psutil.Process(ready.pid)) + time.process_time() - own)
        await handle.stop()
    return Row(
        what,
        runs,
        walls[0],
        statistics.median(walls[1:] or walls),
        statistics.median(cpus[1:] or cpus),
        helpers_cpu(pids) - before,
    )


def worker_specs(work: Path) -> list[tuple[str, WorkerSpec]]:
    onnx = make_mlp(work / "mlp" / "1" / "model.onnx")
    specs = [("worker ready, tiny ONNX", WorkerSpec("mlp", 1, onnx, "onnx", "cpu", (), (), 1))]
    if unavailable_reason("torchscript") is None:
        pt = work / "encoder" / "1" / "model.pt"
        pt.parent.mkdir(parents=True)
        shutil.copy(ROOT / "models" / "encoder" / "1" / "model.pt", pt)
        inputs = (TensorSpec("features", "FP32", (-1, 8)),)
        outputs = (TensorSpec("embedding", "FP32", (-1, 4)),)
        spec = WorkerSpec("encoder", 1, pt, "torchscript", "cpu", inputs, outputs, 1)
        specs.append(("worker ready, tiny TorchScript", spec))
    return specs


async def all_workers(work: Path, runs: int) -> list[Row]:
    return [await workers(what, spec, runs) for what, spec in worker_specs(work)]


def measure_workers(work: str, runs: int) -> None:
    """Run in the `python -c` process: print the workers' rows as JSON."""
    rows = asyncio.run(all_workers(Path(work), runs))
    print(json.dumps([asdict(r) for r in rows]))


def worker_rows(work: Path, runs: int) -> list[Row]:
    code = f"from benchmarks.startup import measure_workers; measure_workers({str(work)!r}, {runs})"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [Row(**r) for r in json.loads(out.splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer starts (CI)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    runs = 3 if args.quick else 8
    with tempfile.TemporaryDirectory(prefix="infergate-startup-") as tmp:
        work = Path(tmp)
        rows = [gateway(runs, work), *cli(runs, work), *worker_rows(work, runs)]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return
    print(f"{'':34} {'starts':>6} {'first s':>8} {'median s':>9} {'CPU s':>6} {'helpers':>8}")
    for r in rows:
        print(
            f"{r.what:34} {r.starts:6} {r.first_s:8.2f} {r.median_s:9.2f} "
            f"{r.median_cpu_s:6.2f} {r.helpers_cpu_s:8.2f}"
        )


if __name__ == "__main__":
    main()
