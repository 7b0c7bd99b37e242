"""NVIDIA Triton beside infergate: the same models, the same load generator, in one run.

    .venv/bin/python benchmarks/triton_peer.py [--quick] [--json] [--runs N] [--rounds N]

Triton 2.51 comes from the nvidia-pytriton wheel in the `bench` extra (`./install.sh
--bench` installs it without its Python dependencies, which pin numpy<2; CI does not install
it), or from --triton-home (a folder laid out as a container's /opt/tritonserver). Its
models run in its Python backend, which runs onnxruntime on the rows of each batch; its
ONNX backend is not in the wheel. Without Triton the script says so and exits 2.

Both servers run at once, each model with the same instances of onnxruntime with one
intra-op thread, batching up to 32 rows or 5 ms where the server has it; the load generator
is infergate's own (infergate/loadgen.py: closed loop, keep-alive connections, JSON V2
bodies, one row per request). Each pair of measurements runs Triton and infergate one after
the other, in alternating order, and the ratio is infergate's figure over Triton's:

- the tiny MLP 64->128->10 at concurrency 1: req/s and p50. Triton serves it from a copy
  without the dynamic batcher, which would hold a lone request for its whole delay;
  infergate from its batched model (its batcher must not make a lone client wait).
- the tiny MLP at concurrency 64: req/s and p99, `--runs` times.
- the MLP 1024->4096->4096->1000 at concurrency 64: rows/s, against onnxruntime in-process
  at batch 32 with the same sessions (one per instance, one thread each, run side by side)
  measured right before each pair.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import tritonserver  # noqa: E402
from infergate.loadgen import LoadResult, prepare, run_concurrency  # noqa: E402
from infergate.loadgen import run as run_load  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import ServerProcess, free_port  # noqa: E402

MAX_BATCH = 32
DELAY_MS = 5
TINY = (64, 128, 10)
BIG = (1024, 4096, 4096, 1000)
BIG_QUICK = (256, 512, 512, 100)


@dataclass(frozen=True)
class Server:
    name: str  # "triton" or "infergate"
    url: str
    pid: int
    models: dict[str, str]  # workload's model -> the server's model name


@dataclass(frozen=True)
class Point:
    rps: float
    p50_ms: float
    p99_ms: float
    front_cpu_us: float  # per request: the server's own process (HTTP, batching, dispatch)
    all_cpu_us: float  # per request: with its model processes (workers, stubs)


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of a process, alone and with its descendants."""

    def of(process: psutil.Process) -> float:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return times.user + times.system

    main = psutil.Process(pid)
    own = of(main)
    return own, own + sum(of(child) for child in main.children(recursive=True))


def measure(server: Server, model: str, width: int, concurrency: int, seconds: float) -> Point:
    x = np.random.default_rng(1).standard_normal((1, width)).astype(np.float32)
    body, headers = prepare({"x": x}, binary=False)
    path = f"/v2/models/{server.models[model]}/infer"
    run_load(run_concurrency(server.url, path, body, headers, concurrency, min(1.0, seconds)))
    front, every = cpu_s(server.pid)
    result: LoadResult = run_load(
        run_concurrency(server.url, path, body, headers, concurrency, seconds)
    )
    front_after, every_after = cpu_s(server.pid)
    if result.failed or not result.ok:
        raise RuntimeError(f"{server.name} {model} c={concurrency}: {result.failures}")
    per_request = 1e6 / result.ok
    return Point(
        result.rps,
        result.p50_ms,
        result.p99_ms,
        (front_after - front) * per_request,
        (every_after - every) * per_request,
    )


def in_process(model: Path, width: int, sessions: int, seconds: float) -> float:
    """Rows/s of onnxruntime called directly at batch 32: `sessions` sessions with one
    intra-op thread each, each run by its own thread (onnxruntime lets go of the GIL)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    runners = [
        ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        for _ in range(sessions)
    ]
    x = np.random.default_rng(0).standard_normal((MAX_BATCH, width)).astype(np.float32)
    done = [0] * sessions
    start = threading.Barrier(sessions + 1)
    stop = threading.Event()

    def loop(i: int) -> None:
        runners[i].run(None, {"x": x})
        start.wait()
        while not stop.is_set():
            runners[i].run(None, {"x": x})
            done[i] += MAX_BATCH

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)  # the run's length is the measurement
    stop.set()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - began)


def pair(
    servers: tuple[Server, Server],
    index: int,
    model: str,
    width: int,
    concurrency: int,
    seconds: float,
) -> dict[str, Point]:
    """Both servers, Triton first on even `index`, infergate first on odd."""
    order = servers if index % 2 == 0 else servers[::-1]
    return {s.name: measure(s, model, width, concurrency, seconds) for s in order}


def write_models(work: Path, big_sizes: tuple[int, ...], instances: int) -> tuple[Path, Path]:
    """The ONNX files, infergate's model folder and Triton's model repository over them."""
    onnx = {"tiny": make_mlp(work / "onnx" / "tiny.onnx", sizes=TINY)}
    onnx["big"] = make_mlp(work / "onnx" / "big.onnx", sizes=big_sizes)
    models = work / "infergate-models"
    for name, path in onnx.items():
        (models / name / "1").mkdir(parents=True)
        (models / name / "1" / "model.onnx").symlink_to(path)
        (models / name / "model.toml").write_text(
            f"instances = {instances}\nthreads = 1\n[batching]\n"
            f"max_batch_size = {MAX_BATCH}\nmax_queue_delay_ms = {DELAY_MS}\n"
        )
    repository = work / "triton-models"
    source = tritonserver.model_py(tritonserver.site_packages())
    shapes = {"tiny": TINY, "big": big_sizes}
    delay_us = DELAY_MS * 1000
    for name, base, delay in (
        ("tiny", "tiny", delay_us),
        ("tiny_direct", "tiny", None),
        ("big", "big", delay_us),
    ):
        sizes = shapes[base]
        config = tritonserver.config_pbtxt(name, sizes[0], sizes[-1], MAX_BATCH, delay, instances)
        tritonserver.write_model(repository, name, onnx[base], config, source)
    return models, repository


def ratio(ours: float, theirs: float) -> float:
    return round(ours / theirs, 3) if theirs else 0.0


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, a smaller big model")
    parser.add_argument("--json", action="store_true")
    # --quick changes the defaults, not what is given.
    parser.add_argument("--runs", type=positive, help="pairs of the tiny c=64 figure (3)")
    parser.add_argument("--rounds", type=positive, help="pairs of the other figures (2)")
    parser.add_argument("--seconds", type=float, help="per measurement (5)")
    parser.add_argument("--instances", type=positive, default=2, help="per model, both servers")
    parser.add_argument(
        "--fronts", type=int, default=0, help="infergate's [server] fronts (0: one process)"
    )
    parser.add_argument("--triton-home", type=Path, help="a Triton folder (default: the wheel's)")
    args = parser.parse_args()
    try:
        install = tritonserver.find_triton(args.triton_home)
    except tritonserver.TritonMissing as exc:
        print(f"triton_peer.py: {exc}", file=sys.stderr)
        sys.exit(2)
    args.runs = args.runs or (1 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.seconds = args.seconds or (1.0 if args.quick else 5.0)
    big_sizes = BIG_QUICK if args.quick else BIG
    with tempfile.TemporaryDirectory(prefix="infergate-triton-peer-") as folder:
        report = serve_and_measure(install, Path(folder), big_sizes, args)
    print_report(report, args.json, args.quick)


def serve_and_measure(
    install: tritonserver.TritonInstall,
    work: Path,
    big_sizes: tuple[int, ...],
    args: argparse.Namespace,
) -> dict[str, Any]:
    models, repository = write_models(work, big_sizes, args.instances)
    profile = work / "profile.toml"
    # Requests wait for a batch, so give them a class whose queue deadline allows it.
    profile.write_text(
        f"[server]\nfronts = {args.fronts}\n"
        '[tenants.default]\nclass = "batch"\nrps = 1000000\nburst = 1000000\n'
        "max_concurrency = 10000\n"
    )
    backends = tritonserver.write_backends(install, work)
    triton = tritonserver.TritonProcess(install, repository, backends, work / "triton.log")
    gateway = ServerProcess(models, profile, work / "infergate.log")
    try:
        triton.start(free_port())
        gateway.start()
        assert triton.process is not None
        assert gateway.process is not None
        # At c=1 Triton serves the copy without its dynamic batcher; infergate its one model.
        servers = (
            Server(
                "triton",
                triton.url,
                triton.process.pid,
                {"tiny": "tiny", "tiny_c1": "tiny_direct", "big": "big"},
            ),
            Server(
                "infergate",
                gateway.url,
                gateway.process.pid,
                {"tiny": "tiny", "tiny_c1": "tiny", "big": "big"},
            ),
        )
        try:
            report = run_all(servers, work, big_sizes, args)
        except RuntimeError as exc:  # a server that stopped answering: say what it logged
            logs = "".join(
                f"\n--- {name}: its log's last lines ---\n{log_tail(path)}"
                for name, path in (("triton", triton.log), ("infergate", gateway.log))
            )
            raise RuntimeError(f"{exc}{logs}") from exc
        report["triton_version"] = triton.version()
    finally:
        gateway.stop()
        triton.stop()
    return report


def log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def run_all(
    servers: tuple[Server, Server], work: Path, big_sizes: tuple[int, ...], args: argparse.Namespace
) -> dict[str, Any]:
    seconds: float = args.seconds
    load_before = os.getloadavg()[0]  # a busy host moves every figure: say how busy it was
    c1 = [pair(servers, i, "tiny_c1", TINY[0], 1, seconds) for i in range(args.rounds)]
    c64 = [pair(servers, i, "tiny", TINY[0], 64, seconds) for i in range(args.runs)]
    big, limits = [], []
    for i in range(args.rounds):
        limits.append(in_process(work / "onnx" / "big.onnx", big_sizes[0], args.instances, seconds))
        big.append(pair(servers, i, "big", big_sizes[0], 64, seconds))

    def med(points: list[dict[str, Point]], server: str, field: str) -> float:
        return float(statistics.median(getattr(p[server], field) for p in points))

    report: dict[str, Any] = {
        "tiny_model": "MLP " + "->".join(map(str, TINY)),
        "big_model": "MLP " + "->".join(map(str, big_sizes)),
        "instances": args.instances,
        "seconds": seconds,
        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }
    for name in ("triton", "infergate"):
        report[name] = {
            "tiny_c1_rps": round(med(c1, name, "rps")),
            "tiny_c1_p50_ms": round(med(c1, name, "p50_ms"), 3),
            "tiny_c64_rps": round(med(c64, name, "rps")),
            "tiny_c64_p99_ms": round(med(c64, name, "p99_ms"), 2),
            "tiny_c64_rps_runs": [round(p[name].rps) for p in c64],
            # CPU per request, counted over the whole run (the requests still out at its
            # end, at most 64, are not counted, so it errs a little high for both)
            "tiny_c64_front_cpu_us": round(med(c64, name, "front_cpu_us")),
            "tiny_c64_all_cpu_us": round(med(c64, name, "all_cpu_us")),
            "big_c64_rows_per_s": round(med(big, name, "rps")),
        }
    report["in_process_batch32_rows_per_s"] = round(statistics.median(limits))
    c64_ratios = [ratio(p["infergate"].rps, p["triton"].rps) for p in c64]
    report["ratios"] = {  # infergate over Triton (for p50: below 1 is infergate faster)
        "tiny_c1_rps": ratio(report["infergate"]["tiny_c1_rps"], report["triton"]["tiny_c1_rps"]),
        "tiny_c1_p50": ratio(
            report["infergate"]["tiny_c1_p50_ms"], report["triton"]["tiny_c1_p50_ms"]
        ),
        "tiny_c64_rps_runs": c64_ratios,
        "tiny_c64_rps": statistics.median(c64_ratios),
        "big_c64_rows": ratio(
            report["infergate"]["big_c64_rows_per_s"], report["triton"]["big_c64_rows_per_s"]
        ),
        "big_infergate_share_of_in_process": ratio(
            report["infergate"]["big_c64_rows_per_s"], report["in_process_batch32_rows_per_s"]
        ),
        "big_triton_share_of_in_process": ratio(
            report["triton"]["big_c64_rows_per_s"], report["in_process_batch32_rows_per_s"]
        ),
    }
    return report


def print_report(report: dict[str, Any], as_json: bool, quick: bool) -> None:
    if as_json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    big = report["big_model"].removeprefix("MLP ")
    print(f"| server | tiny c=1 req/s (p50) | tiny c=64 req/s (p99) | {big} c=64 rows/s |")
    print("|---|---|---|---|")
    labels = {
        "triton": f"Triton {report['triton_version']}, Python backend (onnxruntime)",
        "infergate": "infergate, batching",
    }
    for name, label in labels.items():
        r = report[name]
        print(
            f"| {label} | {r['tiny_c1_rps']:,} ({r['tiny_c1_p50_ms']:.2f} ms) "
            f"| {r['tiny_c64_rps']:,} ({r['tiny_c64_p99_ms']:.1f} ms) "
            f"| {r['big_c64_rows_per_s']:,} |"
        )
    print(f"| onnxruntime in-process, batch 32 | | | {report['in_process_batch32_rows_per_s']:,} |")
    ratios = report["ratios"]
    runs = ", ".join(f"{x:.2f}" for x in ratios["tiny_c64_rps_runs"])
    print(
        f"\ninfergate / Triton: tiny c=1 {ratios['tiny_c1_rps']:.2f}x req/s, "
        f"{ratios['tiny_c1_p50']:.2f}x p50; tiny c=64 {ratios['tiny_c64_rps']:.2f}x req/s "
        f"(runs: {runs}); big c=64 {ratios['big_c64_rows']:.2f}x rows/s"
    )
    print(
        f"share of onnxruntime in-process on the big model: infergate "
        f"{ratios['big_infergate_share_of_in_process']:.0%}, Triton "
        f"{ratios['big_triton_share_of_in_process']:.0%}"
        + (" -- a --quick smoke run, not the measurement" if quick else "")
    )
    t, g = report["triton"], report["infergate"]
    print(
        "CPU per request, tiny c=64 (the server's own process / with its model processes): "
        f"Triton {t['tiny_c64_front_cpu_us']} / {t['tiny_c64_all_cpu_us']} µs, infergate "
        f"{g['tiny_c64_front_cpu_us']} / {g['tiny_c64_all_cpu_us']} µs"
    )
    before, after = report["load_average_1m"]
    print(f"host load average (1 min): {before} at the start, {after} at the end")


if __name__ == "__main__":
    main()
