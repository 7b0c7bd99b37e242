"""What `infergate serve` and the CLI import is what they use: every module imported costs
CPU on every start (the suite starts about fifty gateways and many CLI processes), so a
gateway without [cluster] never imports redis, and a command imports its own module only.
Python writes each import to stderr (PYTHONPROFILEIMPORTTIME), here the server's log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import write_profile
from tests.server import ServerProcess


def imported(log: str) -> set[str]:
    """The modules a -X importtime log names."""
    return {line.rsplit("|", 1)[-1].strip() for line in log.splitlines() if "import time:" in line}


# Runs the CLI as `infergate` does, then writes the modules it imported to stderr.
RUN_CLI = """
import sys
from infergate.cli.main import main
sys.argv = ["infergate", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
sys.stderr.write("\\n".join(sys.modules))
"""
COMMANDS = {"serve", "infer", "doctor", "bench", "top", "model", "tenant", "breaker", "key"}


def cli_modules(*args: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", RUN_CLI, *args], capture_output=True, text=True, timeout=60
    )
    return set(done.stderr.splitlines())


def command_modules(modules: set[str]) -> set[str]:
    return {m.removeprefix("infergate.cli.") for m in modules} & COMMANDS


def test_a_command_imports_its_own_module_and_no_other_commands() -> None:
    served = cli_modules("serve", "-h")
    assert command_modules(served) == {"serve"}
    assert "rich" not in served  # what the other commands print with, and serve does not
    assert command_modules(cli_modules("key", "-h")) == {"key"}
    assert command_modules(cli_modules("--version")) == set()
    # A command that sends no tensors does not import numpy (the client imports it to
    # encode or decode them).
    listed = cli_modules("model", "list", "--json", "--url", "http://127.0.0.1:1")
    assert "infergate.client" in listed
    assert "numpy" not in listed
    # Help that lists every command imports them all, and "Did you mean" still knows them.
    assert command_modules(cli_modules("-h")) == COMMANDS
    typo = subprocess.run(
        [sys.executable, "-m", "infergate", "modle"], capture_output=True, text=True, timeout=60
    )
    assert typo.returncode == 2
    assert "Did you mean 'model'?" in typo.stderr


def test_doctor_reads_a_cpu_torch_without_importing_it() -> None:
    """torch costs about 2 s of CPU to import; a CPU build's version.py says enough."""
    modules = cli_modules("doctor", "--json")
    assert "infergate.cli.doctor" in modules
    assert "torch" not in modules


def test_a_gateway_without_a_cluster_never_imports_redis(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    server = ServerProcess(tmp_path / "models", write_profile(tmp_path), tmp_path / "log", env)
    server.start()
    try:
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    finally:
        server.stop()
    modules = imported(server.log.read_text())
    assert "infergate.engine.engine" in modules  # the log does list the imports
    assert not {m for m in modules if m == "redis" or m.startswith("redis.")}
    assert "infergate.engine.cluster.redis_limits" not in modules
