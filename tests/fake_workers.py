"""In-process workers for timing-rule tests: the worker seam (infergate.engine.workers.
protocol.Worker) implemented without a process, whose calls finish when the test says.

Pass a `FakeWorkers` as EngineContext(worker_factory=...): every worker an Instance starts
is a FakeWorker kept in `made`. A call the scheduler sends waits in `pending` until the
test replies, fails it, times it out, or ends the worker, so time passes only on the
FakeClock."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from infergate.engine.workers.handle import WorkerLoadError
from infergate.engine.workers.messages import Ready, WorkerSpec
from infergate.errors import (
    DeadlineExceeded,
    ModelExecutionError,
    WorkerFailed,
    WorkerOverMemory,
)
from infergate.tensors import Array
from tests.polling import eventually
from tests.scripted_runtime import ScriptedRuntime

_pids = itertools.count(900_001)  # no real process has these (pid_max is far below on CI)
_sent = itertools.count()  # calls in the order they were sent, over all workers


@dataclass(eq=False)
class FakeCall:
    worker: FakeWorker
    inputs: dict[str, Array]
    outputs: list[str]
    future: asyncio.Future[dict[str, Array]]
    on_reply: Callable[[], None] | None
    timeout_s: float | None = None  # what the scheduler gave `wait`: its execution timeout
    seq: int = field(default_factory=lambda: next(_sent))
    # Set by `time_out`: the timer of the real handle's `wait` fired.
    expired: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def rows(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    def reply(self, outputs: dict[str, Array] | None = None) -> None:
        """Answer as the scripted runtime would (y = x, pid, rows), or with `outputs`."""
        if outputs is None:
            rows = self.rows
            made = {
                "y": np.array(self.inputs.get("x", np.zeros((rows, 1), np.float32)), copy=True),
                "pid": np.full((rows, 1), self.worker.pid, np.int64),
                "rows": np.full((rows, 1), rows, np.int64),
            }
            outputs = {n: made[n] for n in self.outputs}
        self._answer(outputs)

    def time_out(self) -> None:
        """Run past the execution timeout, as the real handle's `wait` sees it: the waiter
        gets DeadlineExceeded at once, and the worker is killed, its death (its calls
        failing, `exited`) coming a moment later, once the kill has landed. The call is
        no longer pending: no reply will come."""
        self.worker.pending.remove(self)
        self.expired.set_result(None)

    def fail(self, reason: str = "scripted failure") -> None:
        self._answer(ModelExecutionError(f"model {self.worker.spec.model!r} failed: {reason}"))

    def _answer(self, result: dict[str, Array] | Exception) -> None:
        self.worker.pending.remove(self)
        if isinstance(result, Exception):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)
        if self.on_reply is not None:  # as the real handle: inside the reader, at once
            self.on_reply()


class FakeWorker:
    def __init__(
        self,
        spec: WorkerSpec,
        load_error: str | None,
        start_bug: Exception | None = None,
        loaded: asyncio.Event | None = None,
    ) -> None:
        self.spec = spec
        self._pid = next(_pids)
        self._load_error = load_error
        self._start_bug = start_bug
        self._loaded = loaded
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.death_reason = "the worker exited"
        self.over_memory = False
        self.pending: list[FakeCall] = []
        self.calls: list[FakeCall] = []  # every call it was sent, in order

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    async def start(self, timeout_s: float) -> Ready:
        if self._start_bug is not None:
            raise self._start_bug
        if self._loaded is not None:  # a load (and warm-up) that lasts until the test says
            await self._loaded.wait()
        if self._load_error is not None:
            self.end(self._load_error)
            raise WorkerLoadError(self._load_error)
        inputs, outputs = self.spec.inputs, self.spec.outputs
        if self.spec.path.suffix == ".scripted" and self.spec.path.exists():
            script = ScriptedRuntime(self.spec.path)  # what a real worker would report
            inputs, outputs = script.inputs, script.outputs
        return Ready(self._pid, "cpu", inputs, outputs)

    def begin(
        self,
        inputs: dict[str, Array],
        outputs: list[str],
        on_reply: Callable[[], None] | None = None,
    ) -> asyncio.Future[dict[str, Array]]:
        if not self.alive:
            raise WorkerFailed(f"{self.death_reason}; it is being restarted. Hint: retry shortly")
        future: asyncio.Future[dict[str, Array]] = asyncio.get_running_loop().create_future()
        call = FakeCall(self, inputs, outputs, future, on_reply)
        self.pending.append(call)
        self.calls.append(call)
        return future

    async def wait(
        self,
        future: asyncio.Future[dict[str, Array]],
        timeout_s: float,
        limit_s: float | None = None,
    ) -> dict[str, Array]:
        # The call's own future, as the real handle takes it; a caller that gives up must
        # not cancel it (the real handle awaits a mirror of it), so this awaits a shield.
        call = next((c for c in self.calls if c.future is future), None)
        if call is None:
            return await asyncio.shield(future)
        call.timeout_s = timeout_s
        await asyncio.wait((future, call.expired), return_when=asyncio.FIRST_COMPLETED)
        if future.done():
            return future.result()
        limit_ms = (timeout_s if limit_s is None else limit_s) * 1000
        why = f"was killed: a request ran past the execution timeout of {limit_ms:.0f} ms"
        asyncio.get_running_loop().call_soon(self.end, why)
        raise DeadlineExceeded(
            f"model {self.spec.model!r} did not answer within {limit_ms:.0f} ms; its worker "
            "was killed and is being restarted"
        )

    def end(self, reason: str, over_memory: bool = False) -> None:
        """The worker dies (crash, SIGKILL): its calls fail, as the real handle's do."""
        if not self.alive:
            return
        self.death_reason = f"worker pid {self._pid} {reason}"
        self.over_memory = over_memory
        kind = WorkerOverMemory if over_memory else WorkerFailed
        for call in self.pending:
            if not call.future.done():  # (a call timed out is cancelled by its runner)
                call.future.set_exception(
                    kind(
                        f"model {self.spec.model!r}: {self.death_reason} while running this "
                        "request; it is being restarted. Hint: retry shortly"
                    )
                )
        self.pending.clear()
        self.exited.set_result(None)

    def kill_over_memory(self, why: str) -> None:
        self.end(f"was killed: {why}", over_memory=True)

    async def stop(self, grace_s: float = 5.0) -> None:
        self.end("was stopped")


@dataclass
class FakeWorkers:
    """The factory: makes FakeWorkers and remembers them, newest last."""

    load_error: str | None = None  # set it to make the next workers fail to load
    # Set it to make the next workers' start raise it: a bug, which fails the instance.
    start_bug: Exception | None = None
    # Set it to make the next workers' loads last until it is set.
    loaded: asyncio.Event | None = None
    made: list[FakeWorker] = field(default_factory=list)

    def __call__(self, spec: WorkerSpec) -> FakeWorker:
        worker = FakeWorker(spec, self.load_error, self.start_bug, self.loaded)
        self.made.append(worker)
        return worker

    def pending(self) -> list[FakeCall]:
        """Unanswered calls on every worker, oldest first."""
        return sorted((c for w in self.made for c in w.pending), key=lambda c: c.seq)

    async def next_call(self, what: str = "a call to reach a worker") -> FakeCall:
        """The oldest unanswered call, once there is one."""
        calls = await eventually(self.pending, what=what)
        return calls[0]
