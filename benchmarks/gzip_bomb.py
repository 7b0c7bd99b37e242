"""The gateway's peak memory while it refuses a gzip bomb, at the default 64 MB limit.

    PYTHONPATH=$PWD python benchmarks/gzip_bomb.py [--inflated-gb 2]

Starts `infergate serve` (default limits, the repository's digits model) on a free port,
sends a gzip body of about 2 MB that inflates to 2 GB of zeros, and prints the answer,
the time it took, the gateway's RSS before, its peak RSS during the request (VmHWM, reset
just before), and the slowest /v2/health/live answered meanwhile. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field}")


def _bomb(gigabytes: float) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * 2**20
    parts = [packer.compress(zeros) for _ in range(int(gigabytes * 1024))]
    return b"".join(parts) + packer.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inflated-gb", type=float, default=2.0)
    args = parser.parse_args()
    bomb = _bomb(args.inflated_gb)
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        models = Path(tmp) / "models"
        shutil.copytree(REPO / "models" / "digits", models / "digits")
        profile = Path(tmp) / "profile.toml"
        profile.write_text("[server]\nmax_request_mb = 64\n")
        cmd = [sys.executable, "-m", "infergate", "serve", "--models", str(models)]
        cmd += ["--profile", str(profile), "--port", str(port), "--log-level", "warning"]
        server = subprocess.Popen(cmd, env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # peak := now
            rss_before = _kb(server.pid, "VmRSS")
            done = threading.Event()
            health: list[float] = []

            def poll_health() -> None:
                with httpx.Client(base_url=url) as client:
                    while not done.is_set():
                        t0 = time.monotonic()
                        client.get("/v2/health/live")
                        health.append(time.monotonic() - t0)

            poller = threading.Thread(target=poll_health)
            poller.start()
            started = time.monotonic()
            r = httpx.post(
                f"{url}/v2/models/digits/infer",
                content=bomb,
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
                timeout=120,
            )
            took = time.monotonic() - started
            done.set()
            poller.join()
            peak = _kb(server.pid, "VmHWM")
            print(f"bomb: {len(bomb) / 2**20:.2f} MB gzip, inflates to {args.inflated_gb:g} GB")
            print(f"answer: {r.status_code} {r.json()['error'][:60]}... in {took:.2f} s")
            print(f"gateway RSS before: {rss_before / 1024:.0f} MB")
            grew = (peak - rss_before) / 1024
            print(f"gateway peak RSS during: {peak / 1024:.0f} MB (+{grew:.0f} MB)")
            print(f"health checks meanwhile: {len(health)}, slowest {max(health) * 1000:.0f} ms")
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(30)


if __name__ == "__main__":
    main()
