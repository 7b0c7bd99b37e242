"""The gateway's instructions per request: a cost that does not move with the host.

    .venv/bin/python benchmarks/instructions.py [--tree NAME=PATH ...] [--requests N]
        [--concurrency C] [--quick] [--json]

On this project's shared 2-core VM the same code measured 82 µs of gateway CPU per tiny
request in one hour and 150 µs in the next (`benchmarks/http_cpu.py`): the host's other
tenants slow every instruction, and a change worth 3% disappears in that. The number of
instructions the gateway executes per request does not depend on the host. So this runs a
real `infergate serve` under valgrind's callgrind (the gateway process only: the fork
server and the workers it starts run natively, as they exec a fresh interpreter), waits
until it serves, sends a warm-up, zeroes callgrind's counters, sends N requests from C
keep-alive connections (infergate's raw client, this process, not counted), dumps the
counters, and divides: instructions per request, with everything the gateway's process
does for them (uvicorn, our protocol and lane, decoding, admission, the scheduler, the
worker pipe, encoding, the socket calls' user-space side) and a few timer ticks of its own
(the event-loop lag sample, every 0.25 s: under 1% of a run).

The workload is `http_cpu.py`'s: the tiny MLP 64→128→10, JSON tensors both ways, two
one-thread instances, batching up to 32 rows or 5 ms. Under valgrind the gateway runs
about 50 times slower while its workers do not, so a batch rarely waits for another to
finish: batches hold about 5 rows here against 17-18 on the real machine, and per-batch
costs weigh more (the mean batch is printed). `--concurrency 1` prices a lone client's
request instead, batch and all. The same code gives the same count to within about 0.5%
from run to run.

`--tree NAME=PATH` (repeatable) measures other checkouts too, one after another, and
prints each one's ratio to the first. Needs valgrind (Debian: `apt-get install valgrind`);
each tree takes about a minute (most of it the gateway's start under valgrind).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from http_cpu import drive, tiny_setup  # noqa: E402

from tests.server import ServerProcess  # noqa: E402

_TOTALS = re.compile(rb"^(?:summary|totals): (\d+)", re.M)


def _counts(url: str) -> tuple[int, int]:
    """The tiny model's (rows, batches) so far, from its Triton statistics."""
    doc = httpx.get(f"{url}/v2/models/tiny/stats", timeout=30).json()["model_stats"][0]
    return int(doc["inference_count"]), int(doc["execution_count"])


def _control(what: str, pid: int) -> None:
    """callgrind_control `what` (--zero, --dump) for the gateway under callgrind."""
    subprocess.run(["callgrind_control", what, str(pid)], check=True, capture_output=True)


def measure(tree: Path, requests: int, concurrency: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="infergate-instr-"))
    here = os.getcwd()
    try:
        models, profile, body, headers = tiny_setup(work)  # (it moves into `work`)
        out = work / "callgrind.out"
        paths = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
        server = ServerProcess(
            models,
            profile,
            work / "gateway.log",
            env={"PYTHONPATH": paths},
            launcher=("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"),
        )
        try:
            server.start(timeout_s=600)  # about half a minute under valgrind
            assert server.process is not None
            url = server.url
            uvloop.run(drive(url, body, headers, max(200, requests // 5), concurrency))
            rows, batches = _counts(url)
            _control("--zero", server.process.pid)  # the start and warm-up not counted
            uvloop.run(drive(url, body, headers, requests, concurrency))
            _control("--dump", server.process.pid)
            rows_after, batches_after = _counts(url)  # after the dump: not counted
        finally:
            if server.process is not None:  # no drain: the dump is all that was wanted
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()
        dumps = sorted(work.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        if not dumps:
            raise RuntimeError(f"callgrind wrote no dump:\n{server.log.read_text()}")
        found = _TOTALS.search(dumps[-1].read_bytes())
        if found is None:
            raise RuntimeError(f"no totals in {dumps[-1]}")
        return {
            "instructions_per_request": int(found.group(1)) / requests,
            "mean_batch": (rows_after - rows) / max(1, batches_after - batches),
        }
    finally:
        os.chdir(here)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH; default: this")
    parser.add_argument("--requests", type=int, default=2000, help="counted, per tree")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a short pass (CI smoke test)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions.py needs valgrind: apt-get install -y valgrind", file=sys.stderr)
        sys.exit(2)
    if args.quick:
        args.requests = 300
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    report: dict[str, Any] = {}
    for name, tree in trees.items():
        report[name] = measure(Path(tree).resolve(), args.requests, args.concurrency)
    first = report[next(iter(report))]["instructions_per_request"]
    for row in report.values():
        row["ratio_to_first"] = round(row["instructions_per_request"] / first, 4)
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"tiny MLP, JSON, c={args.concurrency}: gateway instructions per request "
        f"(callgrind, {args.requests} requests a tree)"
    )
    for name, row in report.items():
        print(
            f"  {name:10s} {row['instructions_per_request'] / 1000:8.1f} k  "
            f"(mean batch {row['mean_batch']:.1f}, ratio to the first {row['ratio_to_first']})"
        )


if __name__ == "__main__":
    main()
