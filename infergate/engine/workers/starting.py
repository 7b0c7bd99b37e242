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
still learns each worker's pid at start and its exit code from its sentinel (the fork
server reaps it and reports the code), and kills it through a pidfd taken at start (the
fork server reaps it, so by then its pid alone could name another process). A worker's
environment is the gateway's when the worker starts (passed along, since the fork server's
is a snapshot of its own start), and every worker holds the read end of a lifeline pipe
whose write end only the gateway holds: when the gateway dies, even by SIGKILL, its workers
exit, including one stuck in a model call; the fork server exits once they all have.

multiprocessing runs the script that started the gateway again in each worker, before the
worker's own code (not a module run with -m): the `infergate` console script imports only
infergate.cli.main, which imports nothing.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext

PRELOAD = ["infergate.engine.workers.worker"]

# The process's one fork server (multiprocessing keeps one per process); nothing else in
# the gateway forks through it.
_context: ForkServerContext = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)
_lifeline: tuple[Connection, Connection] | None = None
_warmed = False
_warming: asyncio.Future[None] | None = None


def context() -> ForkServerContext:
    """The context to start a worker with; `ensure_server()` first."""
    return _context


def ensure_server() -> None:
    """Start the fork server if it is not running (the first time, or after it died), on
    the gateway's sys.path. It does not inherit sys.path (Python 3.11 ignores the one
    multiprocessing passes it): it would import the worker module from wherever its own
    default path finds infergate (the current directory first), maybe another copy than
    the gateway runs, so it is started with the gateway's path as PYTHONPATH. Workers get
    the gateway's environment back as they start. Not starting a process is a waitpid."""
    path = os.pathsep.join(p or os.getcwd() for p in sys.path)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    try:
        forkserver.ensure_running()
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
    """Start the fork server, off the event loop. Its first fork waits for the server to
    import what it preloads; done here once per process, in a thread, no start blocks the
    loop on it. Concurrent first callers wait for the one start (and try themselves if it
    failed)."""
    global _warmed, _warming
    while not _warmed:
        loop = asyncio.get_running_loop()
        if _warming is not None and _warming.get_loop() is loop and not _warming.done():
            await asyncio.shield(_warming)
            continue
        _warming = warming = loop.create_future()
        try:
            ensure_server()
            await asyncio.to_thread(_first_fork)
            _warmed = True
        finally:
            warming.set_result(None)


def _first_fork() -> None:
    process = _context.Process(target=os.getpid, name="infergate-forkserver-warmup", daemon=True)
    process.start()
    process.join()
    process.close()
