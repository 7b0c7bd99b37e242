"""Health latency, measured from a process of its own.

A probe in the test's own process measures the test as well: its garbage collector (a
full collection of pytest's heap holds every thread of the process, and took 54 to 174 ms
on a busy 2-core machine: that was test_edge_requests' "slow health answer", with the
gateway's loop idle) and whatever else of the test holds the GIL meanwhile (an upload,
psutil, admin calls). So the probe is a small process that asks for /v2/health/live again
and again until told to stop, and reports when each answer started and ended on the
system's monotonic clock, the one the test's time.monotonic() reads too."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from tests.edge_raw import Reply, connect, head, read_reply
from tests.polling import wait_until

_PROBE = """
import os, sys, time, httpx
url, ready, stop, pause_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
out = []
with httpx.Client(timeout=10) as client:
    client.get(url)  # connect first: the connection is not what is measured
    open(ready, "w").close()
    while not os.path.exists(stop):
        started = time.monotonic()
        assert client.get(url).status_code == 200
        out.append((started, time.monotonic()))
        if pause_s:
            time.sleep(pause_s)
print(repr(out))
"""


class HealthProbe:
    """Probing from construction (once its first answer came) until `stop()`; as a
    context manager, the process is gone when the block ends, whatever happened."""

    def __init__(self, url: str, folder: Path, pause_s: float = 0.0) -> None:
        ready, self._stop = folder / "probe-ready", folder / "probe-stop"
        ready.unlink(missing_ok=True)
        self._stop.unlink(missing_ok=True)
        self._process = subprocess.Popen(
            [sys.executable, "-c", _PROBE, f"{url}/v2/health/live", str(ready), str(self._stop)]
            + [str(pause_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: ready.exists() or self._process.poll() is not None, what="a probe")
        assert self._process.poll() is None, "the health probe exited before it began"

    def stop(self) -> list[tuple[float, float]]:
        """Each answer's start and end (time.monotonic()), in order."""
        self._stop.touch()
        out, _ = self._process.communicate(timeout=60)
        assert self._process.returncode == 0, "the health probe failed (see its stderr)"
        return list(ast.literal_eval(out))

    def __enter__(self) -> HealthProbe:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.communicate()


def upload_while_probing(
    url: str, port: int, path: str, body: bytes, headers: dict[str, str], folder: Path
) -> tuple[Reply | None, list[tuple[float, float]]]:
    """POST `body` (raw, in one send) while a probe asks for health: the reply, and each
    health answer that started after the upload was sent and ended before the reply, as
    (seconds after the upload, seconds it took)."""
    headers = {"Content-Length": str(len(body)), **headers}
    with HealthProbe(url, folder) as probe, connect(port) as sock:
        sock.sendall(head("POST", path, port, headers) + body)
        sent = time.monotonic()
        reply = read_reply(sock, timeout_s=120)
        answered = time.monotonic()
        checks = probe.stop()
    return reply, [(s - sent, e - s) for s, e in checks if s >= sent and e <= answered]


def slow_answers(
    during: list[tuple[float, float]], limit_s: float = 0.1
) -> list[tuple[float, float]]:
    """The answers of `upload_while_probing` that took `limit_s` or more, rounded."""
    return [(round(after, 3), round(took, 3)) for after, took in during if took >= limit_s]
