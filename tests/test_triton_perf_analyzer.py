"""Triton's perf_analyzer against `infergate serve` started as the README says (no
--profile): binary tensors, JSON tensors, and system shared memory.

perf_analyzer is a native binary set up by scripts/perf_analyzer_setup.sh into
.tools/perf_analyzer (it downloads a wheel and Debian libraries, so it needs the network
once). Where it is not set up this test is skipped, and says so in the summary (-ra); with
INFERGATE_REQUIRE_PERF_ANALYZER=1 (as `.ci/run` sets, after running the setup script) it
fails instead, so that CI cannot pass by skipping it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server import free_port
from tests.triton_models import make_simple

REPO = Path(__file__).resolve().parent.parent
PERF_ANALYZER = REPO / ".tools" / "perf_analyzer" / "perf_analyzer"

REQUIRED = os.environ.get("INFERGATE_REQUIRE_PERF_ANALYZER") == "1"
MISSING = "perf_analyzer is not set up: run scripts/perf_analyzer_setup.sh (needs the network)"

pytestmark = pytest.mark.skipif(not PERF_ANALYZER.exists() and not REQUIRED, reason=MISSING)


@pytest.fixture(scope="module", autouse=True)
def perf_analyzer_is_set_up() -> None:
    """Where it is required (INFERGATE_REQUIRE_PERF_ANALYZER=1), its absence is a failure
    (before any server starts)."""
    if not PERF_ANALYZER.exists():
        pytest.fail(f"{MISSING}; INFERGATE_REQUIRE_PERF_ANALYZER=1 says it must be")


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`infergate serve --models DIR --port P`, no profile: the repository's default one."""
    folder = tmp_path_factory.mktemp("perf")
    make_simple(folder / "models" / "simple" / "1" / "model.onnx")
    port = free_port()
    with (folder / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "infergate", "serve", "--models", str(folder / "models")]
            + ["--port", str(port)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert process.poll() is None, (folder / "server.log").read_text()
        try:
            if httpx.get(f"http://{url}/v2/models/simple/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    yield url
    os.killpg(process.pid, signal.SIGINT)
    process.wait(timeout=30)


@pytest.mark.parametrize(
    "mode",
    [
        [],
        ["--input-tensor-format", "json", "--output-tensor-format", "json"],
        ["--shared-memory", "system"],
    ],
    ids=["binary", "json", "system-shm"],
)
def test_perf_analyzer_runs(plain_server: str, mode: list[str]) -> None:
    # A fixed request count: no stability loop, so a busy machine gives the same verdict.
    command = [str(PERF_ANALYZER), "-m", "simple", "-u", plain_server, "-i", "http"]
    done = subprocess.run(
        [*command, "--request-count", "100", *mode],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The client's count. The server-side figure perf_analyzer prints is the difference of
    # two statistics reads around its run; it came out 99 for 100 answered requests once in
    # three CI runs (shm mode), so it is not asserted; failures are read from the server.
    assert "Request count: 100" in done.stdout, done.stdout
    stats = httpx.get(f"http://{plain_server}/v2/models/simple/stats").json()
    [version] = stats["model_stats"]
    assert version["inference_stats"]["fail"]["count"] == 0  # every request succeeded
    status = httpx.get(f"http://{plain_server}/v2/systemsharedmemory/status").json()
    assert status == []  # perf_analyzer unregistered what it registered
