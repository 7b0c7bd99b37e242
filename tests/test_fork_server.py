"""The fork server the workers are forked from, and where a worker runs: a fork server
that dies or hangs never holds the gateway (a new one starts the next worker), workers
outlive it and are reported as they can be, a worker start never waits behind asyncio's
thread pool, a stopped gateway leaves nothing behind, and a lone request is served by
the worker on the gateway's core. Each test starts its own gateway (no shared one), so
this file runs beside test_workers.py."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from infergate.engine.workers import forking, starting
from tests.conftest import write_profile
from tests.polling import process_gone, wait_until
from tests.scripted_runtime import holding, make_scripted, scripted_inputs
from tests.server import ServerProcess
from tests.worker_calls import Background, instance_pid

# Loaded by every new interpreter the gateway starts (it is on PYTHONPATH): once the test
# creates `hold`, a fork server that starts waits there until `release` exists, as one
# importing its preload on a busy machine would, only for as long as the test wants.
FORKSERVER_HOLD = """\
import os, time
_gates = {gates!r}
with open("/proc/self/cmdline", "rb") as _f:
    _forkserver = b"multiprocessing.forkserver" in _f.read()
if _forkserver and os.path.exists(os.path.join(_gates, "hold-forkserver")):
    with open(os.path.join(_gates, "forkserver-held"), "w") as _f:
        _f.write(str(os.getpid()))
    while not os.path.exists(os.path.join(_gates, "release-forkserver")):
        time.sleep(0.01)
"""


def held_fork_server_gateway(tmp_path: Path, profile: str = "") -> tuple[ServerProcess, Path]:
    """A gateway serving `solo` (a scripted model) whose fork servers, once the test asks,
    hold their start until released; and its gates."""
    models, gates, hooks = tmp_path / "models", tmp_path / "gates", tmp_path / "hooks"
    gates.mkdir(parents=True)
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FORKSERVER_HOLD.format(gates=str(gates)))
    make_scripted(models / "solo" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path}
    server = ServerProcess(models, write_profile(tmp_path, profile), tmp_path / "server.log", env)
    return server.start(), gates


def fork_server_of(server: ServerProcess, model: str) -> int:
    """The fork server: the parent of the model's worker."""
    [worker] = server.worker_pids(model)
    return psutil.Process(worker).ppid()


def test_a_killed_fork_server_is_started_again_off_the_event_loop(tmp_path: Path) -> None:
    """A fork server killed (the OOM killer, an operator) is started again by the next
    worker start, and the gateway keeps answering while it imports what it preloads; one
    that does not come up counts against the load timeout, like a worker that does not."""
    profile = "[server]\nmax_request_mb = 1\nload_timeout_s = 5\n"
    server, gates = held_fork_server_gateway(tmp_path, profile)
    try:
        old_server = fork_server_of(server, "solo")
        [old_worker] = server.worker_pids("solo")
        (gates / "hold-forkserver").touch()
        os.kill(old_server, signal.SIGKILL)
        os.kill(old_worker, signal.SIGKILL)  # the restart needs a fork server
        held = gates / "forkserver-held"
        wait_until(held.exists, what="a new fork server to start")
        # Meanwhile: the event loop is not waiting on it.
        for _ in range(3):
            live = httpx.get(f"{server.url}/v2/health/live", timeout=10)
            assert live.status_code == 200
        assert httpx.get(f"{server.url}/v2/models/solo/ready", timeout=10).status_code == 503
        wait_until(
            lambda: (
                "fork server did not start within the 5 s load timeout"
                in (server.model("solo")["versions"][0]["instances"][0]["reason"] or "")
            ),
            what="the start to time out",
        )
        (gates / "release-forkserver").touch()
        model = server.wait_model_state("solo", "ready")
        pid = model["versions"][0]["instances"][0]["pid"]
        assert psutil.Process(pid).ppid() == int(held.read_text())
        answer = httpx.post(f"{server.url}/v2/models/solo/infer", json=scripted_inputs(hold=0))
        assert answer.json()["outputs"][1]["data"] == [pid]
    finally:
        (gates / "release-forkserver").touch()
        server.stop()


def test_a_worker_killed_after_its_fork_server_died_is_not_given_a_made_up_exit_code(
    tmp_path: Path,
) -> None:
    """The fork server reports each worker's exit; once it is dead nobody can, and the
    worker's exit is learnt from the worker itself, not from the fork server's death."""
    server, gates = held_fork_server_gateway(tmp_path)
    try:
        [worker] = server.worker_pids("solo")
        os.kill(fork_server_of(server, "solo"), signal.SIGKILL)
        hanging = Background(f"{server.url}/v2/models/solo/infer", scripted_inputs(hold=1))
        held = wait_until(lambda: holding(gates, 1), what="the call to be held")
        assert held == [worker]  # the same worker: its fork server's death did not end it
        os.kill(worker, signal.SIGKILL)
        response = hanging.result()
        assert response.status_code == 503
        error = response.json()["error"]
        assert f"worker pid {worker} is gone" in error, error
        assert "code 255" not in error
    finally:
        server.stop()


def test_a_lone_client_is_served_by_the_worker_pinned_to_the_gateways_core(
    tmp_path: Path,
) -> None:
    """With a CPU worker pinned to each core, a request that finds both free goes to the
    one on the core the gateway's event loop runs on: woken there, it starts on the core
    the gateway leaves idle as it waits for it, instead of another core being woken."""
    models = tmp_path / "models"
    make_scripted(models / "duo" / "1" / "model.scripted", ("sleep_ms",))
    (models / "duo" / "model.toml").write_text("instances = 2\nthreads = 1\n")
    server = ServerProcess(models, write_profile(tmp_path), tmp_path / "server.log").start()
    try:
        first, second = instance_pid(server, "duo", 0), instance_pid(server, "duo", 1)
        [core] = os.sched_getaffinity(second)
        assert core not in os.sched_getaffinity(first), "a worker pinned to each core"
        assert server.process is not None
        os.sched_setaffinity(server.process.pid, {core})  # the loop's thread: the main one
        for _ in range(20):  # one at a time: both instances are free each time
            answer = httpx.post(
                f"{server.url}/v2/models/duo/infer", json=scripted_inputs(sleep_ms=0)
            )
            assert answer.json()["outputs"][1]["data"] == [second]
    finally:
        server.stop()


async def test_a_worker_start_never_waits_behind_asyncios_thread_pool() -> None:
    """The fork server's start and each fork run in threads of their own: with every
    thread of asyncio's shared pool held by slow jobs (device samples on a busy machine),
    a worker still starts at once, and a healthy fork server is not taken for hung."""
    loop = asyncio.get_running_loop()
    release = threading.Event()
    held = [loop.run_in_executor(None, release.wait) for _ in range(64)]  # > the pool
    try:
        await asyncio.wait_for(starting.ready(), 30)
        context = starting.context()
        parent, child = context.Pipe()
        process = context.Process(target=os.getpid, daemon=True)
        server = await forking.fork(process, child, answer_s=5.0, abandoned=lambda: None)
        assert server == starting.server_pid()
        process.join(30)
        assert process.exitcode == 0
        parent.close()
    finally:
        release.set()
        await asyncio.gather(*held)
        await starting.stop()


@contextlib.contextmanager
def hung(pid: int) -> Iterator[None]:
    """Process `pid` stopped, as a fork server that is alive but never answers; let go
    after (a SIGCONT to a process killed since is nothing)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_hung_fork_server_never_holds_the_gateway_and_a_new_one_starts_workers(
    tmp_path: Path,
) -> None:
    """A worker start asks the fork server for a fork; one that is alive but hung never
    answers. The gateway asks from a thread, so it goes on serving; past a few seconds it
    kills the hung one, and the start, tried again, gets a new one, within the load
    timeout."""
    server, gates = held_fork_server_gateway(tmp_path, "[server]\nload_timeout_s = 4\n")
    old_server = fork_server_of(server, "solo")
    make_scripted(tmp_path / "models" / "second" / "1" / "model.scripted", ("hold",))
    loaded: list[httpx.Response] = []
    try:
        with hung(old_server):
            loading = threading.Thread(
                target=lambda: loaded.append(
                    httpx.post(f"{server.url}/v2/repository/models/second/load", timeout=60)
                )
            )
            loading.start()
            wait_until(
                lambda: "model_loading second" in server.log.read_text(), what="the load to start"
            )
            for _ in range(3):  # meanwhile: the loop and the other model's worker serve
                assert httpx.get(f"{server.url}/v2/health/live", timeout=2).status_code == 200
                url = f"{server.url}/v2/models/solo/infer"
                assert httpx.post(url, json=scripted_inputs(hold=0), timeout=2).status_code == 200
            loading.join(60)
            assert [r.status_code for r in loaded] == [200], loaded and loaded[0].text
        [worker] = server.worker_pids("second")
        assert psutil.Process(worker).ppid() != old_server
        wait_until(lambda: process_gone(old_server), what="the hung fork server to be reaped")
        assert f"the fork server (pid {old_server}) is hung" in server.log.read_text()
    finally:
        server.stop()


def test_a_worker_that_dies_under_a_hung_fork_server_fails_its_calls_and_restarts(
    tmp_path: Path,
) -> None:
    """A dead worker's exit is reported by its fork server; a hung one never reports. Past
    a few seconds the gateway kills it: the dead worker's call fails (503, not a hang)
    and the worker restarts under a new fork server."""
    server, gates = held_fork_server_gateway(tmp_path)
    try:
        [worker] = server.worker_pids("solo")
        old_server = fork_server_of(server, "solo")
        with hung(old_server):
            hanging = Background(f"{server.url}/v2/models/solo/infer", scripted_inputs(hold=1))
            wait_until(lambda: holding(gates, 1), what="the call to be held")
            os.kill(worker, signal.SIGKILL)
            response = hanging.result()
            assert response.status_code == 503
            assert f"worker pid {worker} is gone" in response.json()["error"]
        model = server.wait_model_state("solo", "ready")
        pid = model["versions"][0]["instances"][0]["pid"]
        assert pid != worker
        assert psutil.Process(pid).ppid() != old_server
        answer = httpx.post(f"{server.url}/v2/models/solo/infer", json=scripted_inputs(hold=0))
        assert answer.json()["outputs"][1]["data"] == [pid]
    finally:
        server.stop()


def test_a_stopped_gateway_leaves_no_worker_or_fork_server_behind(tmp_path: Path) -> None:
    """Its workers and its fork server are gone when it has exited: reaped, the fork server
    by the gateway, not left to PID 1 (where their CPU time would count for nobody). (The
    body decoder's pool leaves multiprocessing's resource tracker to exit after it.)"""
    for stop in (signal.SIGINT, signal.SIGTERM):
        server, _ = held_fork_server_gateway(tmp_path / stop.name)
        assert server.process is not None
        fork_server = psutil.Process(fork_server_of(server, "solo"))
        family = [fork_server, *fork_server.children(recursive=True)]
        server.process.send_signal(stop)
        server.process.wait(timeout=30)
        left = [p for p in family if p.is_running()]  # a zombie too: nobody reaped it
        assert not left, [(p.pid, p.name()) for p in left]


def without_pidfds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel before Linux 5.3, which has no pidfd_open (ENOSYS)."""

    def pidfd_open(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", pidfd_open)


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfds", "no-pidfds"])
async def test_stopping_reaps_the_fork_server_and_kills_one_that_does_not_exit(
    pidfds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's stop reaps its fork server, with or without pidfds (kernels before
    5.3 have none): one that exits when asked, and one that never does (stopped), which
    is killed once the grace time is up."""
    if not pidfds:
        without_pidfds(monkeypatch)
    for stopped in (False, True):
        await asyncio.wait_for(starting.ready(), 30)
        pid = starting.server_pid()
        assert pid is not None
        if stopped:
            os.kill(pid, signal.SIGSTOP)
        await asyncio.wait_for(starting.stop(grace_s=0.2), 30)
        assert starting.server_pid() is None
        with pytest.raises(ChildProcessError):  # reaped: not a zombie left to PID 1
            os.waitpid(pid, os.WNOHANG)


async def test_a_hung_fork_server_is_killed_without_pidfds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the kernel has no pidfds, a hung fork server is killed by its pid (still this
    process's unreaped child, so it names no other process)."""
    without_pidfds(monkeypatch)
    await asyncio.wait_for(starting.ready(), 30)
    pid = starting.server_pid()
    assert pid is not None
    try:
        with hung(pid):
            starting.kill_hung(pid, "a test")
            wait_until(lambda: starting.server_pid() is None, what="the fork server to die")
    finally:
        await asyncio.wait_for(starting.stop(), 30)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    # The killed one was reaped by stop(), not by multiprocessing, which still named it:
    # a later engine in this process must still get a fork server (it failed every
    # worker start with ChildProcessError).
    await asyncio.wait_for(starting.ready(), 30)
    assert starting.server_pid() not in (None, pid)
    await asyncio.wait_for(starting.stop(), 30)
