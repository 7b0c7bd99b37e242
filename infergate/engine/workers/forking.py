"""One worker's fork, asked of the fork server from a thread of its own.

`Process.start()` blocks until the fork server answers with the new pid, which a hung one
(stopped, stuck) never does; on the event loop that would stop the whole gateway. So each
start runs in a thread started for it (not asyncio's shared pool, where a queue of slow
jobs ahead of it would pass for a hung fork server), and a watchdog on the loop kills the
fork server if the thread has not come back from `start()` within `answer_s` of
beginning: killed, it can no longer answer, and the thread ends (its reply pipe reads
EOF). The watchdog stays armed when the caller gives up (a stopping instance), so a hung
fork server is killed either way, and whatever the thread started for a caller that is
gone is handed to `abandoned`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from infergate.engine.workers import starting
from infergate.errors import WorkerStartError


async def fork(
    process: BaseProcess,
    child: Connection,
    answer_s: float,
    abandoned: Callable[[], None],
) -> int | None:
    """Start `process` (closing the parent's copy of `child`, its end of the worker's pipe,
    once the fork server has it); the pid of the fork server that forked it."""
    returned = threading.Event()  # start() came back: too late to call the server hung
    asked: list[int | None] = [None]  # the fork server the thread asks

    def run() -> int | None:
        try:
            # Here, not only on the loop: start() itself would start a missing fork server,
            # without the gateway's path (see starting.ensure_server).
            starting.ensure_server()
            asked[0] = starting.server_pid()
            starting.start(process)
            returned.set()
            return asked[0]
        finally:
            child.close()

    hung = False

    def watchdog() -> None:
        nonlocal hung
        if not returned.is_set():
            hung = True
            starting.kill_hung(asked[0], f"a worker start took over {answer_s:.1f} s")

    forking = asyncio.ensure_future(starting.in_own_thread(run))
    timer = asyncio.get_running_loop().call_later(answer_s, watchdog)
    forking.add_done_callback(lambda _: timer.cancel())
    try:
        # Killed, a hung fork server lets the thread go at once; the second answer_s only
        # bounds a thread that something else holds.
        return await asyncio.wait_for(asyncio.shield(forking), 2 * answer_s)
    except (asyncio.CancelledError, TimeoutError) as exc:
        forking.add_done_callback(_consume)
        forking.add_done_callback(lambda _: abandoned())
        if isinstance(exc, TimeoutError):
            raise WorkerStartError(_hung_message(answer_s)) from None
        raise
    except Exception:
        if hung:
            raise WorkerStartError(_hung_message(answer_s)) from None
        raise


def _consume(done: asyncio.Future[int | None]) -> None:
    """Read the outcome of a fork nobody awaits any more (asyncio logs one left unread)."""
    if not done.cancelled():
        done.exception()


def _hung_message(answer_s: float) -> str:
    return (
        f"the fork server did not fork the worker within {answer_s:.1f} s (hung); it was "
        "killed, and the next try starts a new one"
    )
