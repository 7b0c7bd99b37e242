"""A real redis-server (Debian's package) on a free loopback port, for the cluster tests."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.server import free_port


def have_redis_server() -> bool:
    return shutil.which("redis-server") is not None


class RedisProcess:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisProcess:
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.folder),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((self.folder / "redis.log").read_text())
            time.sleep(0.02)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def now(self) -> float:
        """Redis's own clock (TIME), in seconds: what leases are scored by."""
        seconds, micros = self.client().time()
        return float(seconds) + micros / 1e6

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process cannot die
            self.process.kill()
            self.process.wait()
