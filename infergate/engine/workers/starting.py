"""How a worker process starts: forked from multiprocessing's fork server, not spawned.

A spawned worker is a fresh interpreter that imports the worker module and numpy before it
can read its model (about 0.25 s of CPU each, and the suite starts hundreds). The fork
server is one such interpreter per gateway, started on the first worker start, that has
already imported the worker module; each worker is a fork of it and starts at once.

What is preloaded there is only what every worker imports anyway, and nothing that starts
threads or touches a GPU: a fork keeps only the forking thread, and CUDA cannot be used in
a child of a process that initialised it. numpy's OpenBLAS starts its thread pool at
import, but stops it around fork (pthread_atfork) and restarts it on first use, so a
forked child is clean. The runtimes are not preloaded: onnxruntime starts a thread at
import, and torch would make every worker's resident memory (what the monitor and the
simulated GPUs count) 200 MB larger and cost 2 s of CPU in gateways that serve no
TorchScript; each worker imports its own runtime after the fork, after it has set
CUDA_VISIBLE_DEVICES, its CPUs and niceness, as a spawned worker did.

The fork server is a child of the gateway and the workers are its children: the gateway
still learns each worker's pid at start, that it exited from a pidfd taken at start, and
how from its sentinel (the fork server reaps it and reports the code), and kills it through
the pidfd (the fork server reaps it, so by then its pid alone could name another process).
A worker's environment is the gateway's when the worker starts (passed along, since the
fork server's is a snapshot of its own start), and every worker holds the read end of a
lifeline pipe whose write end only the gateway holds: when the gateway dies, even by
SIGKILL, its workers exit, including one stuck in a model call; the fork server exits once
they all have. When the engine stops, it stops the fork server and reaps it, so nothing of
a gateway outlives it (and the fork server's CPU, its workers' included, counts in the
gateway's children's).

A fork server that dies (the OOM killer, an operator) is started again, off the event loop
and within the load's timeout, by the next worker start: `ready()` remembers which fork
server it warmed. One that is alive but hung (stopped, or stuck) would hold every worker
start and every worker's exit report for good, so the gateway never waits on it with the
loop: a start forks in a thread, and a fork server that does not answer a start or report
an exit in time is killed (`kill_hung()`); its workers live on, and the next start runs a
new one.

multiprocessing runs the script that started the gateway again in each worker, before the
worker's own code (not a module run with -m): the `infergate` console script imports only
infergate.cli.main, which imports nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

log = logging.getLogger("infergate.workers")
T = TypeVar("T")
PRELOAD = ["infergate.engine.workers.worker"]

# The process's one fork server (multiprocessing keeps one per process); nothing else in
# the gateway forks through it.
_context: ForkServerContext = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)
_lifeline: tuple[Connection, Connection] | None = None
_warmed_pid: int | None = None  # the fork server `ready()` last warmed
_warming: asyncio.Task[None] | None = None
_killed: set[int] = set()  # fork servers `kill_hung` killed (a pid each: a few at most)
_EXIT_POLL_S = 0.01  # how often `stop` looks for the fork server's exit without a pidfd


def context() -> ForkServerContext:
    """The context to start a worker with; `ensure_server()` first."""
    return _context


def _server() -> Any:
    """multiprocessing's ForkServer (private: it has no public view of its pid)."""
    return forkserver._forkserver


def server_pid() -> int | None:
    """The fork server's pid while it runs; None when none was started or it died (it is
    this process's child: a dead one is a zombie until multiprocessing reaps it, so the
    pid cannot name another process; WNOWAIT leaves the reaping to multiprocessing)."""
    pid: int | None = _server()._forkserver_pid
    if pid is None:
        return None
    try:
        exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return None
    return pid if exited is None else None


def kill_hung(pid: int | None, why: str) -> None:
    """Kill fork server `pid` if it is still the one running: it did not answer in time.
    Through a pidfd taken while it is this process's unreaped child, so that a start
    reaping it meanwhile (in another thread) cannot make `pid` name another process. Its
    workers are not its to take along (they watch the gateway's lifeline, not it)."""
    if pid is None:
        return
    try:
        pidfd = open_pidfd(pid)
    except ProcessLookupError:
        return  # reaped already
    try:
        if server_pid() != pid:
            return  # gone already, or a new one runs
        log.warning("the fork server (pid %d) is hung: %s; killing it, a new one starts", pid, why)
        _killed.add(pid)
        _kill(pid, pidfd)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _forget(server: Any) -> None:
    """Forget a fork server reaped here, as multiprocessing forgets one it reaped itself:
    its `ensure_running` would otherwise wait for the pid, no longer this process's child,
    and raise ChildProcessError at every later worker start in this process."""
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = None
    server._forkserver_alive_fd = None
    server._forkserver_pid = None


def open_pidfd(pid: int) -> int | None:
    """A pidfd for child `pid`; None where the kernel has none (before Linux 5.3: ENOSYS),
    and then the pid itself is used: the fork server is this process's child, so until it
    is reaped its pid names no other process."""
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise  # ProcessLookupError among them: the caller's to handle
        return None


def _kill(pid: int, pidfd: int | None) -> None:
    if pidfd is None:
        os.kill(pid, signal.SIGKILL)
    else:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)


async def _exit_of(pid: int, pidfd: int | None) -> None:
    """Return once child `pid` has exited, leaving it unreaped: its pidfd reads ready
    then; without one, the pid is polled (only on kernels without pidfds)."""
    if pidfd is None:
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            await asyncio.sleep(_EXIT_POLL_S)
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)


def is_gone(pid: int | None) -> bool:
    """Whether fork server `pid` is no longer the one running: exited, or killed here (its
    pipes close a moment before it has exited, and its workers' sentinels with them)."""
    return pid in _killed or server_pid() != pid


def start(process: BaseProcess) -> None:
    """`process.start()`, run in a thread (`WorkerHandle._fork`), then off multiprocessing's
    set of children: each start polls every child in that set, reading the exit code of
    one that died from its sentinel, which would race the gateway's own read of it on the
    event loop (`WorkerHandle._on_exit`) and could leave a worker's exit unknown. The
    gateway reaps its workers itself (`_on_exit`), and its lifeline ends them."""
    process.start()
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]


def ensure_server() -> None:
    """Start the fork server if it is not running (the first time, or after it died), on
    the gateway's sys.path. It does not inherit sys.path (Python 3.11 ignores the one
    multiprocessing passes it): it would import the worker module from wherever its own
    default path finds infergate (the current directory first), maybe another copy than
    the gateway runs, so it is started with the gateway's path as PYTHONPATH, set only
    around that start (other threads may read the environment). Workers get the gateway's
    environment back as they start."""
    if server_pid() is not None:
        return
    path = os.pathsep.join(p or os.getcwd() for p in sys.path)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    try:
        forkserver.ensure_running()
        _killed.discard(_server()._forkserver_pid)  # a new one may have a killed one's pid
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def lifeline() -> Connection:
    """The read end of this gateway's lifeline, for each worker to watch. The write end
    stays here, open until the process ends; nothing is ever sent on it, so a worker reads
    EOF exactly when the gateway is gone."""
    global _lifeline
    if _lifeline is None:
        _lifeline = _context.Pipe(duplex=False)
    return _lifeline[0]


async def ready() -> None:
    """Start the fork server, off the event loop, unless the one warmed last still runs.
    Its first fork waits for the server to import what it preloads; done here, in a
    thread, no start blocks the loop on it: the first time, and again when the fork server
    died or was stopped. Concurrent callers wait for the one start (and try themselves if
    it failed). The caller bounds its wait (a hung fork server would hold it forever); a
    caller that gives up leaves the start running, for the next caller to wait on."""
    global _warming
    loop = asyncio.get_running_loop()
    while _warmed_pid is None or server_pid() != _warmed_pid:
        if _warming is None or _warming.done() or _warming.get_loop() is not loop:
            _warming = loop.create_task(_warm_off_loop())
            await asyncio.shield(_warming)
            return
        await asyncio.wait({_warming})  # another caller's start; then look again


async def _warm_off_loop() -> None:
    global _warmed_pid
    _warmed_pid = await in_own_thread(_warm)


async def in_own_thread(call: Callable[[], T]) -> T:
    """`call()` in a thread started for it, not asyncio's shared pool, whose threads may
    all be held by slow jobs (device samples, file work): a fork server start or a fork
    must not wait behind those, nor pass for hung because it did."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, error: BaseException | None) -> None:
        if result.done():
            return
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        value, error = None, None
        try:
            value = call()
        except BaseException as exc:  # noqa: BLE001 (raised in the caller, on the loop)
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="infergate-forkserver", daemon=True).start()
    return await result


def _warm() -> int | None:
    ensure_server()
    process = _context.Process(target=os.getpid, name="infergate-forkserver-warmup", daemon=True)
    process.start()
    process.join()
    process.close()
    return server_pid()


async def stop(grace_s: float = 5.0) -> None:
    """Stop the fork server and reap it: it exits once its pipe from the gateway closes
    and every worker it forked has exited (each holds that pipe too); killed if it has not
    within `grace_s`. Without this it outlived the gateway, an orphan of PID 1."""
    global _warmed_pid
    server = _server()
    for killed in _killed:  # reaped by the next start, unless there is none
        with contextlib.suppress(ChildProcessError):
            reaped, _ = os.waitpid(killed, os.WNOHANG)
            if reaped and killed == server._forkserver_pid:
                _forget(server)
    pid = server_pid()
    if pid is None:
        return
    pidfd = open_pidfd(pid)  # its child, unreaped: the pid is still this process's
    try:
        os.close(server._forkserver_alive_fd)  # what multiprocessing's own _stop does
        server._forkserver_alive_fd = None
        server._forkserver_pid = None
        _warmed_pid = None
        try:
            await asyncio.wait_for(_exit_of(pid, pidfd), grace_s)
        except TimeoutError:
            log.warning("the fork server did not exit within %.0f s; killing it", grace_s)
            _kill(pid, pidfd)
            await _exit_of(pid, pidfd)
        os.waitpid(pid, 0)  # it has exited: does not block
    finally:
        if pidfd is not None:
            os.close(pidfd)
