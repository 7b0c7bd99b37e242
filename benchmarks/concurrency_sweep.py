"""Throughput as concurrency rises (the "no cliff" check): the tiny MLP 64->128->10
through the real server, JSON bodies, batching max 32 / 5 ms, one intra-op thread, closed
loop at c = 1, 2, 3, 4, 8, with 1-row and 2-row requests. Throughput should never fall as
clients are added, and a lone client should never wait the batching delay.

To compare two versions of the code in one run on a shared machine, give each tree
(`--tree NAME=PATH`, a checkout or an export of one): all servers run at once and are
measured alternately level by level, the order flipped each round, so the machine's
drift hits them alike; each cell is the median of the rounds.

    .venv/bin/python benchmarks/concurrency_sweep.py [--tree before=/tmp/old] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infergate.loadgen import prepare, run_concurrency  # noqa: E402
from infergate.loadgen import run as run_load  # noqa: E402
from tests.onnx_models import make_mlp  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

PROFILE = """
[batching]
max_batch_size = 32
max_queue_delay_ms = 5
[tenants.default]
class = "batch"
rps = 1000000
burst = 1000000
max_concurrency = 10000
"""
PATH = "/v2/models/tiny/infer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH; default: this")
    parser.add_argument("--levels", default="1,2,3,4,8", help="concurrencies")
    parser.add_argument("--rows", default="1,2", help="rows per request")
    parser.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    levels = [int(c) for c in args.levels.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    work = Path(tempfile.mkdtemp(prefix="infergate-sweep-"))
    models = work / "models"
    make_mlp(models / "tiny" / "1" / "model.onnx", sizes=(64, 128, 10))
    (models / "tiny" / "model.toml").write_text("threads = 1\n")
    profile = work / "profile.toml"
    profile.write_text(PROFILE)
    # `python -m infergate` puts its working directory first on sys.path, ahead of
    # PYTHONPATH: start the servers from one that holds no code, so each runs its tree.
    os.chdir(work)
    servers = {}
    try:
        for name, tree in trees.items():
            env = {"PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
            log = work / f"{name}.log"
            servers[name] = ServerProcess(models, profile, log, env=env).start()
        bodies = {}
        for rows in row_counts:
            x = np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32)
            bodies[rows] = prepare({"x": x}, binary=False)
        for server in servers.values():  # warm up: the first requests pay for imports
            run_load(run_concurrency(server.url, PATH, *bodies[row_counts[0]], 2, 1.0))
        cells: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for rows in row_counts:
                for c in levels:
                    for name in order:
                        url = servers[name].url
                        out = run_load(run_concurrency(url, PATH, *bodies[rows], c, args.seconds))
                        cells.setdefault((name, rows, c), []).append((out.rps, out.p50_ms))
    finally:
        for server in servers.values():
            server.stop()
    print(f"req/s (p50 ms), median of {args.rounds} rounds of {args.seconds} s")
    for rows in row_counts:
        print(f"{rows}-row requests")
        for name in servers:
            line = []
            for c in levels:
                got = cells[(name, rows, c)]
                rps = statistics.median(r for r, _ in got)
                p50 = statistics.median(p for _, p in got)
                line.append(f"c={c} {rps:6.0f} ({p50:5.2f})")
            print(f"  {name:8s} " + "  ".join(line))


if __name__ == "__main__":
    main()
