"""Where a request's Python goes: the interpreter's opcodes per function, per request.

    .venv/bin/python benchmarks/opcodes.py [--tree PATH] [--requests N] [--concurrency C]
        [--top K] [--lines] [--json]

`benchmarks/instructions.py` says how many instructions a request costs, not where; a
sampling profiler says where, but its samples follow the host's speed and the profiler's
own pauses. This counts instead: it serves `http_cpu.py`'s workload (the tiny MLP, JSON
both ways, 64 keep-alive connections) from a real `infergate serve` whose main thread, on
a signal, traces every opcode it executes (`sys.settrace` with `f_trace_opcodes`) and
tallies them by function until a second signal, and prints the opcodes per request of each
source file and of the top functions. The counts do not depend on the host (batching does
a little: a batch's work is shared by its rows). Traced, the gateway runs many times
slower, so the figures are for comparing code, not for timing it. C functions (numpy,
orjson, dict and list operations) execute no opcodes: their cost is in
`instructions.py`'s count only. `--lines` lists source lines instead of functions, and
names each dataclass `__init__` and NamedTuple constructor (code Python makes from a
string, `<string>` otherwise) by the class it builds: where a function's opcodes go.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()


def _tracer(frame: FrameType, event: str, arg: object) -> Any:
    frame.f_trace_opcodes = True
    if event == "opcode":
        code = frame.f_code
        _COUNTS[(code.co_filename, code.co_name)] += 1
    return _tracer


def _line_tracer(frame: FrameType, event: str, arg: object) -> Any:
    """`--lines`: by source line; code made from a string (a dataclass's `__init__`, a
    NamedTuple's `__new__`) is named by the class it builds."""
    frame.f_trace_opcodes = True
    if event == "opcode":
        code = frame.f_code
        if code.co_filename == "<string>":
            made = frame.f_locals.get("self", frame.f_locals.get("_cls"))
            made = made if isinstance(made, type) else type(made)
            where = f"{code.co_name}[{made.__name__}]"
        else:
            where = f"{code.co_name}:{frame.f_lineno}"
        _COUNTS[(code.co_filename, where)] += 1
    return _line_tracer


def _start(*_: object) -> None:
    _COUNTS.clear()
    sys.settrace(_line_tracer if os.environ.get("OPCODES_LINES") else _tracer)


def _stop(*_: object) -> None:
    sys.settrace(None)
    rows = [[count, file, name] for (file, name), count in _COUNTS.most_common()]
    Path(os.environ["OPCODES_OUT"]).write_text(json.dumps(rows))


def serve_traced(argv: list[str]) -> None:
    """`infergate serve ARGV`, counting opcodes between SIGUSR1 and SIGUSR2."""
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    from infergate.cli.main import main as cli

    sys.argv = ["infergate", "serve", *argv]
    cli()


def count(
    tree: Path, requests: int, concurrency: int, lines: bool = False
) -> list[tuple[int, str, str]]:
    sys.path[:0] = [str(tree), str(ROOT / "benchmarks")]
    import uvloop
    from http_cpu import drive, tiny_setup

    from tests.server import free_port, wait_ready

    work = Path(tempfile.mkdtemp(prefix="infergate-opcodes-"))
    models, profile, body, headers = tiny_setup(work)
    port, out, log = free_port(), work / "opcodes.json", work / "gateway.log"
    env = {**os.environ, "PYTHONPATH": str(tree), "OPCODES_OUT": str(out)}
    if lines:
        env["OPCODES_LINES"] = "1"
    command = [sys.executable, __file__, "--serve-traced", "--models", str(models)]
    command += ["--profile", str(profile), "--port", str(port)]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, log)
        uvloop.run(drive(url, body, headers, 3_000, 64))  # warm up, untraced
        os.kill(process.pid, signal.SIGUSR1)
        time.sleep(0.5)  # the handler runs between two of the loop's steps
        uvloop.run(drive(url, body, headers, requests, concurrency))
        os.kill(process.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    if not out.exists():
        raise RuntimeError(f"the traced gateway wrote no counts:\n{log.read_text()}")
    prefix = f"{tree}/"
    site = str(Path(sys.prefix) / "lib")
    return [
        (int(n), f.replace(prefix, "").replace(site, "<venv lib>"), name)
        for n, f, name in json.loads(out.read_text())
    ]


def main() -> None:
    if sys.argv[1:2] == ["--serve-traced"]:
        serve_traced(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to serve")
    parser.add_argument("--requests", type=int, default=3_000, help="traced")
    parser.add_argument("--top", type=int, default=40, help="functions to list")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--lines", action="store_true", help="by source line (the functions list's rows)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = count(args.tree.resolve(), args.requests, args.concurrency, args.lines)
    per = args.requests
    total = sum(n for n, _, _ in rows)
    by_file: collections.Counter[str] = collections.Counter()
    for n, file, _ in rows:
        by_file[file] += n
    if args.json:
        print(json.dumps({"opcodes_per_request": total / per, "functions": rows[: args.top]}))
        return
    print(
        f"tiny MLP, JSON, c={args.concurrency}: {total / per:.0f} opcodes per request "
        f"({per} traced)"
    )
    for file, n in by_file.most_common(15):
        print(f"  {n / per:7.1f} {100 * n / total:5.1f}%  {file}")
    print("  by line:" if args.lines else "  by function:")
    for n, file, name in rows[: args.top]:
        print(f"  {n / per:7.1f} {100 * n / total:5.1f}%  {file}:{name}")


if __name__ == "__main__":
    main()
