"""Whether a request's client is still there: work done only for its answer stops when
it leaves.

A client that sends a request and closes its connection at once (a flood that never reads
its answers) left the gateway reading, decoding and running every one of its requests for
nobody: with four threads sending 1 MB bodies that way for 10 s, another tenant's one-row
requests took 88 ms at the median and 504 ms at p99, and 106 ms for 10 s more, while the
gateway worked through the flood's backlog (benchmarks/departed_flood.py; now 7 ms, 27
ms, then 1 ms). So the HTTP protocol keeps a `Departure` for each connection, and the
engine one for each request a front passes on (server/front_link.py); the infer route
asks it before it decodes a body or queues a request, and has it cancel what the request
waits for (`unless_gone`) when the client leaves meanwhile: a request queued and not yet
batched is then never run (the scheduler drops a job whose caller gave up), and its
answer is a 499, nginx's "client closed request", in the access log and the metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from infergate.errors import ClientGone

T = TypeVar("T")
# The ASGI scope's key for the request's Departure (the HTTP protocol sets it).
DEPARTURE_KEY = "infergate.departure"
# The message of a cancellation for a client that left (a wait is cancelled for other
# reasons too: the drain's end), which the infer route answers with a counted 499.
GONE = "infergate: the client left"


def cancel_for_departure(waiting: asyncio.Future[Any]) -> None:
    """Cancel what a request waits on because its client left."""
    waiting.cancel(msg=GONE)


def cancelled_error(future: asyncio.Future[Any]) -> asyncio.CancelledError:
    """The CancelledError of a cancelled `future`, with its message."""
    try:
        future.result()
    except asyncio.CancelledError as exc:
        return exc
    raise AssertionError("not cancelled")


def is_departure(error: BaseException) -> bool:
    """Whether `error` is the cancellation of a wait whose client left."""
    return isinstance(error, asyncio.CancelledError) and error.args[:1] == (GONE,)


class Departure:
    """One connection's leaving (or, behind a front, one request's client's)."""

    __slots__ = ("_closing", "_listen", "_left", "_watchers")

    def __init__(
        self,
        closing: Callable[[], bool] | None = None,
        listen: Callable[[], None] | None = None,
    ) -> None:
        # The transport's is_closing: true from the moment the client's end of the
        # connection is read, a step of the loop before the protocol's connection_lost,
        # which a body read in the same step would otherwise beat.
        self._closing = closing
        # Reads the connection again: uvicorn stops reading a connection while a large
        # body waits to be taken, and only an ASGI `receive` starts it again, so its end
        # would go unseen for as long as its request waits.
        self._listen = listen
        self._left = False
        self._watchers: set[Callable[[], None]] = set()

    @property
    def gone(self) -> bool:
        return self._left or (self._closing is not None and self._closing())

    def listen(self) -> None:
        """Read the connection again (see `__init__`), if it can be."""
        if self._listen is not None:
            self._listen()

    def watch(self, cancel: Callable[[], None]) -> None:
        """Call `cancel` when the client leaves (unless `unwatch`ed before)."""
        self._watchers.add(cancel)

    def unwatch(self, cancel: Callable[[], None]) -> None:
        self._watchers.discard(cancel)

    async def look(self) -> None:
        """Read the connection once more before work is done for its request: a body over
        uvicorn's 64 KB is read with the connection paused after each piece, so a client
        that sent it and closed is not seen to have left until the connection is read
        again (such bodies were decoded for nobody, a millisecond of the loop each)."""
        if self._listen is not None and not self.gone:
            self.listen()
            await asyncio.sleep(0)  # the loop's next look at its sockets

    def left(self) -> None:
        """The client has gone: every wait `unless_gone` watches is cancelled."""
        if self._left:
            return
        self._left = True
        self._closing = self._listen = None  # what they are bound to may go now
        watchers, self._watchers = self._watchers, set()
        for watcher in watchers:
            watcher()


class _Cancel:
    """Cancels one task when its client leaves, and remembers that it did (a task is
    cancelled for other reasons too: the drain's end)."""

    __slots__ = ("task", "fired")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self.task.cancel(msg=GONE)


async def unless_gone(departure: Departure | None, awaitable: Awaitable[T]) -> T:
    """What `awaitable` gives; ClientGone, with the wait cancelled, once the client leaves.
    The caller asks `gone` first: what `awaitable` stands for may have begun already."""
    if departure is None:
        return await awaitable
    task = asyncio.current_task()
    assert task is not None
    cancel = _Cancel(task)
    departure.watch(cancel)
    departure.listen()  # (a pipelined request's head may have paused reading again)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not cancel.fired:
            raise
        task.uncancel()
        raise ClientGone() from None
    finally:
        departure.unwatch(cancel)
