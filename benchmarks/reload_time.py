"""Reload time of the example model: replace models/digits' file five times on a running
server and measure, for each swap, the server's own figure (file stable -> new version
serving: verify, spawn, load, warm up, swap) and what a client sees (file written -> first
answer from the new file, which adds the file_stable_s wait).

    .venv/bin/python benchmarks/reload_time.py [--stable-s 1.0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server import ServerProcess  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stable-s", type=float, default=1.0, help="the profile's file_stable_s")
    parser.add_argument("--swaps", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="infergate-reload-"))
    shutil.copytree(ROOT / "models" / "digits", work / "models" / "digits")
    profile = work / "profile.toml"
    profile.write_text(f"[server]\nfile_stable_s = {args.stable_s}\n")
    server = ServerProcess(work / "models", profile, work / "server.log").start()
    target = work / "models" / "digits" / "1" / "model.onnx"
    proto = onnx.load(str(target))
    server_s, client_s = [], []
    try:
        for k in range(args.swaps):
            proto.doc_string = f"revision {k}"  # a new file, the same model
            staged = target.with_name(".model.onnx.tmp")
            onnx.save(proto, str(staged))
            seen = max(e["id"] for e in server.model("digits")["events"])
            written = time.monotonic()
            os.replace(staged, target)
            while True:
                events = server.model("digits")["events"]
                ready = [e for e in events if e["id"] > seen and e["kind"] == "model_ready"]
                if ready:
                    client_s.append(time.monotonic() - written)
                    server_s.append(ready[0]["data"]["load_s"])
                    break
                time.sleep(0.01)
            assert httpx.get(f"{server.url}/v2/models/digits/ready").status_code == 200
    finally:
        server.stop()
    print(f"swaps: {args.swaps}, file_stable_s = {args.stable_s}")
    print(
        f"file stable -> new version serving: median {statistics.median(server_s) * 1000:.0f} ms"
        f" (min {min(server_s) * 1000:.0f}, max {max(server_s) * 1000:.0f})"
    )
    print(
        f"file written -> new version serving: median {statistics.median(client_s) * 1000:.0f}"
        f" ms (includes the {args.stable_s:g} s stability wait)"
    )


if __name__ == "__main__":
    main()
