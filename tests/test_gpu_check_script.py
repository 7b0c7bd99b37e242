"""scripts/gpu_check.py, the check a GPU machine runs, run here on the simulated GPU: the same
gateway, models, placements, answers against the CPU's and memory kill, so that the script
still works the day a GPU machine runs it."""

from __future__ import annotations

import subprocess
import sys

from tests.server import REPO, free_port


def test_the_gpu_check_passes_on_the_simulated_gpu() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--backend", "simulated", "--bench-s", "0"]
        + ["--port", str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "ok   encoder: every instance placed on sim:0 and running on cpu" in lines
    assert "ok   digits: the GPU's answer matches the CPU's (max |diff| 0.0)" in lines
    assert (
        "ok   encoder-capped: its worker over memory_mb 64 is killed and the reason says memory"
        in lines
    )
    assert lines[-1] == "all checks passed"
