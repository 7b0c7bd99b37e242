"""The infer route's requests whose answer waits (server/infer_route.py,
`InferRoute.answer_now`): a batch's result, or a large answer finished in a task. Each
answer reaches the lane's `respond`, a 500 for a bug included: a client is never left
without one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from infergate.engine.admission.tenants import TenantState
from infergate.engine.engine import Running
from infergate.engine.lifecycle.served import ServedVersion
from infergate.errors import CompressLater, LargeAnswer
from infergate.server.codec import DecodedRequest
from infergate.server.departure import cancelled_error
from infergate.server.reply import Reply, internal_error

if TYPE_CHECKING:
    from infergate.server.infer_route import InferRoute

log = logging.getLogger("infergate.server")


class Waiting:
    """An `answer_now` request whose answer waits: what that answer needs, and the done
    callback of what it waits on (one object instead of two bound partials: fewer
    allocations and call levels a request)."""

    __slots__ = (
        "route",
        "name",
        "running",
        "decoded",
        "served",
        "state",
        "started",
        "raw_headers",
        "respond",
        "answered",
        "front_encodes",
    )

    def __init__(
        self,
        route: InferRoute,
        name: str,
        running: Running,
        decoded: DecodedRequest,
        served: ServedVersion,
        state: TenantState,
        started: float,
        raw_headers: list[tuple[bytes, bytes]],
        respond: Callable[[Reply | None], None],
    ) -> None:
        self.route = route
        self.name = name
        self.running = running
        self.decoded = decoded
        self.served = served
        self.state = state
        self.started = started
        self.raw_headers = raw_headers
        self.respond = respond
        self.answered = False
        self.front_encodes = False  # the request came decoded from a front, which encodes

    def __call__(self, future: asyncio.Future[Any]) -> None:
        """The done callback on the scheduler's future."""
        if future.cancelled():  # the gateway stops, or the client left (with its message)
            self.answer(None, cancelled_error(future))
            return
        error = future.exception()
        self.answer(None if error is not None else future.result(), error)

    async def after(self, waiting: Coroutine[Any, Any, Any]) -> None:
        """The task of a request that must be awaited (its own batch, a sequence's step)."""
        try:
            outcome = await waiting
        except asyncio.CancelledError as exc:  # the drain's end: answered 503 by the lane
            self.answer(None, exc)
            raise
        except Exception as exc:
            self.answer(None, exc)
            return
        self.answer(outcome, None)

    def unstarted(self, waiting: Coroutine[Any, Any, Any], task: asyncio.Task[None]) -> None:
        """The done callback of `after`'s task: one cancelled before its first step never
        ran `after`, and is answered (and its tenant's slot let go) here; what it was to
        await (a batch on a worker already) is still awaited to its end, its timeout
        kept, its outcome dropped."""
        if self.answered or not task.cancelled():
            return
        self.answer(None, cancelled_error(task))
        orphan = self.route.loop().create_task(waiting, name="infer-orphan")
        orphan.add_done_callback(dropped)

    def answer(self, outcome: Any, error: BaseException | None) -> None:
        """`respond` with the answer, where a bug answers 500 and closes the connection
        (as the lane's task does) instead of leaving the client without an answer."""
        self.answered = True
        try:
            reply = self.route.settled(self, outcome, error)
        except (LargeAnswer, CompressLater) as large:  # a task finishes it, and responds
            self.route.finish_later(
                self.respond, self.name, self.state, large, self.started, self.raw_headers
            )
            return
        except Exception:
            log.exception("infer failed after its wait")
            reply = internal_error()
        self.respond(reply)


class Later:
    """The task of a large answer to an `answer_now` request: `respond` gets its Reply
    once `finishing` has made it, or None when it was cancelled, even before its first
    step (then `finishing` never ran)."""

    __slots__ = ("respond", "finishing", "responded")

    def __init__(
        self, respond: Callable[[Reply | None], None], finishing: Coroutine[Any, Any, Reply]
    ) -> None:
        self.respond = respond
        self.finishing = finishing
        self.responded = False

    async def run(self) -> None:
        try:
            reply = await self.finishing
        except asyncio.CancelledError:
            self._give(None)
            raise
        except Exception:  # a bug: answered 500, never left hanging
            log.exception("infer failed while its answer was finished")
            reply = internal_error()
        self._give(reply)

    def done(self, task: asyncio.Task[None]) -> None:
        if not self.responded:  # cancelled before its first step
            self.finishing.close()
            self._give(None)

    def _give(self, reply: Reply | None) -> None:
        self.responded = True
        self.respond(reply)


def dropped(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: nobody waits for it
