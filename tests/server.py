"""A real `infergate serve` in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0
) -> None:
    """Until `GET {url}/v2/health/ready` answers 200: any V2 server (infergate, Triton) that
    `process` runs. RuntimeError with its log when it exits first or is not ready in time."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{log.read_text()}")
            try:
                if client.get(f"{url}/v2/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"server not ready in {timeout_s:.0f} s:\n{log.read_text()}")


class ServerProcess:
    def __init__(
        self,
        models: Path,
        profile: Path,
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        args: tuple[str, ...] = (),
        launcher: tuple[str, ...] = (),
    ) -> None:
        # `cwd`: where the server runs, so that a relative `profile` is read as a user's
        # `infergate serve` in their project folder reads profiles/default.toml.
        self.models = models
        self.profile = profile
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._env = {**os.environ, **(env or {})}
        self._cwd = cwd
        self._args = args  # more of `infergate serve`'s options
        self._launcher = launcher  # a command the server runs under (valgrind ...)
        if cwd is not None:  # run elsewhere, it still imports this checkout (and tests/)
            paths = [str(REPO), self._env.get("PYTHONPATH", "")]
            self._env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90.0) -> ServerProcess:
        # free_port() lets the port go before the server binds it, and tests running in
        # parallel (pytest -n) open connections meanwhile: one may take it. The server says
        # so in one line and exits at once; start it again on another port.
        for _ in range(3):
            if self._start(timeout_s):
                return self
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
        raise RuntimeError(f"no free port after 3 tries:\n{self.log.read_text()}")

    def _start(self, timeout_s: float) -> bool:
        """Whether the server came up; False if its port was taken before it bound it."""
        logged = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *self._launcher,
                    sys.executable,
                    "-m",
                    "infergate",
                    "serve",
                    "--models",
                    str(self.models),
                    "--profile",
                    str(self.profile),
                    "--port",
                    str(self.port),
                    *self._args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                cwd=self._cwd,
                start_new_session=True,  # so a test can signal the whole group
            )
        deadline = time.monotonic() + timeout_s
        # One client for every look (a new one per look costs more CPU than the server's
        # start-up), and a look a few times a second while the server is not yet listening.
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    said = self.log.read_bytes()[logged:].decode(errors="replace")
                    if f"cannot listen on 127.0.0.1:{self.port}" in said:
                        return False
                    raise RuntimeError(f"server exited early:\n{self.log.read_text()}")
                try:
                    if client.get(f"{self.url}/v2/health/ready").status_code == 200:
                        return True
                    time.sleep(0.02)  # up, loading its models
                except httpx.TransportError:
                    time.sleep(0.05)  # not listening yet: importing
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{self.log.read_text()}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGINT (a drain), then SIGKILL to its whole group past `grace_s`."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def model(self, name: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/admin/models/{name}", timeout=5)
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    def worker_pids(self, name: str) -> list[int]:
        return [
            i["pid"]
            for v in self.model(name)["versions"]
            for i in v["instances"]
            if i["pid"] is not None
        ]

    def wait_model_state(self, name: str, state: str, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            model = self.model(name)
            if model["state"] == state:
                return model
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} is {model['state']}, not {state}: {model}")
            time.sleep(0.05)
