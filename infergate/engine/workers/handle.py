"""One worker process as the gateway's event loop sees it.

Replies are futures keyed by call id, read off the pipe by a loop reader (no threads);
when the pipe hits EOF the worker is gone and every future it held fails at once.

A call is sent synchronously (`begin`) and awaited separately (`wait`), and whoever sends
it may pass `on_reply`, which runs inside the pipe reader the moment the reply is read,
before any task wakes: the scheduler hands the worker its next batch from there, so the
worker does not sit idle while the event loop works through other callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from infergate.engine.workers.messages import (
    InferCall,
    InferDone,
    InferFailed,
    LoadFailed,
    Ready,
    Stop,
    WorkerSpec,
    decode,
    encode,
)
from infergate.engine.workers.shm import OwnedArena, layout_size, read_tensor, write_tensors
from infergate.engine.workers.worker import worker_main
from infergate.errors import (
    DeadlineExceeded,
    ModelExecutionError,
    WorkerFailed,
    WorkerOverMemory,
)
from infergate.tensors import Array, from_wire

log = logging.getLogger("infergate.workers")
_SPAWN = multiprocessing.get_context("spawn")
INITIAL_ARENA = 1 << 20


class WorkerLoadError(Exception):
    """The worker could not load its model; the message says why."""


class WorkerHandle:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._ids = itertools.count(1)
        self._pending: dict[int, _Call] = {}
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Ready] = self._loop.create_future()
        self.exited: asyncio.Future[None] = self._loop.create_future()
        self._in = OwnedArena(INITIAL_ARENA)
        self._out = OwnedArena(INITIAL_ARENA)
        self._conn: Connection
        self._process: BaseProcess
        self.death_reason = "the worker exited"
        self.over_memory = False

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    async def start(self, timeout_s: float) -> Ready:
        """Spawn the process and wait until its model is loaded and warmed up."""
        self._conn, child = _SPAWN.Pipe(duplex=True)
        self._process = _SPAWN.Process(
            target=worker_main,
            args=(child, self.spec),
            name=f"infergate-worker:{self.spec.model}:{self.spec.version}",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            self.kill(f"it did not finish loading within {timeout_s:.0f} s")
            raise WorkerLoadError(f"loading took longer than {timeout_s:.0f} s") from None

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._dispatch(decode(self._conn.recv_bytes()))
        except (EOFError, OSError):
            self._on_exit()

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Ready):
            self._ready.set_result(message)
        elif isinstance(message, LoadFailed):
            self.death_reason = message.reason
            if not self._ready.done():
                self._ready.set_exception(WorkerLoadError(message.reason))
        elif isinstance(message, (InferDone, InferFailed)):
            call = self._pending.pop(message.id, None)
            if call is None:
                return  # it timed out; the worker is being killed
            if not call.future.done():
                try:
                    call.future.set_result(self._outputs(message))
                except ModelExecutionError as exc:
                    call.future.set_exception(exc)
            if call.on_reply is not None:
                try:
                    call.on_reply()
                except Exception:  # a bug there must not stop this pipe being read
                    log.exception("worker pid %s: reply hook failed", self.pid)

    def _outputs(self, reply: InferDone | InferFailed) -> dict[str, Array]:
        """The reply's tensors, copied out of the arena before the next call can reuse it."""
        if isinstance(reply, InferFailed):
            raise ModelExecutionError(
                f"model {self.spec.model!r} version {self.spec.version} failed: {reply.reason}"
            )
        if reply.inline is not None:
            self._out.close()
            self._out = OwnedArena(reply.needed * 2)
            return {
                r.name: from_wire(reply.inline[r.name], r.datatype, r.shape) for r in reply.outputs
            }
        return {r.name: read_tensor(self._out.buf, r, copy=True) for r in reply.outputs}

    def _on_exit(self) -> None:
        if self.exited.done():
            return
        self._loop.remove_reader(self._conn.fileno())
        self._conn.close()
        self._process.join(timeout=1.0)  # EOF means it is exiting; reap it for the exit code
        code = self._process.exitcode
        how = (
            f"was killed by signal {-code}"
            if code is not None and code < 0
            else (f"exited with code {code}")
        )
        if self.death_reason == "the worker exited":
            self.death_reason = f"worker pid {self.pid} {how}"
        if not self._ready.done():
            self._ready.set_exception(WorkerLoadError(self.death_reason))
        failure = WorkerOverMemory if self.over_memory else WorkerFailed
        error = failure(
            f"model {self.spec.model!r} version {self.spec.version}: {self.death_reason} "
            "while running this request; it is being restarted. Hint: retry shortly"
        )
        for call in self._pending.values():
            if not call.future.done():
                call.future.set_exception(error)
        self._pending.clear()
        self._in.close()
        self._out.close()
        self.exited.set_result(None)

    def kill_over_memory(self, why: str) -> None:
        self.over_memory = True
        self.kill(why)

    def kill(self, why: str) -> None:
        """SIGKILL the worker; its futures fail when the pipe reports EOF."""
        self.death_reason = f"worker pid {self.pid} was killed: {why}"
        if self._process.is_alive():
            self._process.kill()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask the worker to exit after its current call; kill it if it does not."""
        if not self.alive:
            return
        with contextlib.suppress(OSError):
            self._conn.send_bytes(encode(Stop()))
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), grace_s)
        except TimeoutError:
            self.kill(f"it did not stop within {grace_s:.0f} s")
            await self.exited

    def begin(
        self,
        inputs: dict[str, Array],
        outputs: list[str],
        on_reply: Callable[[], None] | None = None,
    ) -> asyncio.Future[dict[str, Array]]:
        """Send one call now. The caller makes sure no other call is in flight (the worker
        has one pair of arenas); `on_reply` runs as soon as the reply is read."""
        if not self.alive:
            raise WorkerFailed(f"{self.death_reason}; it is being restarted. Hint: retry shortly")
        needed = layout_size(inputs)
        if needed > self._in.size:
            self._in.close()
            self._in = OwnedArena(needed * 2)
        refs = write_tensors(self._in.buf, inputs)
        call = InferCall(
            next(self._ids), self._in.name, self._out.name, self._out.size, refs, tuple(outputs)
        )
        future: asyncio.Future[dict[str, Array]] = self._loop.create_future()
        self._pending[call.id] = _Call(future, on_reply)
        self._conn.send_bytes(encode(call))
        return future

    async def wait(
        self, future: asyncio.Future[dict[str, Array]], timeout_s: float
    ) -> dict[str, Array]:
        """The outputs of a call `begin` sent; a call past `timeout_s` kills the worker."""
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            self.kill(f"a request ran past the execution timeout of {timeout_s * 1000:.0f} ms")
            raise DeadlineExceeded(
                f"model {self.spec.model!r} version {self.spec.version} did not answer within "
                f"{timeout_s * 1000:.0f} ms; its worker was killed and is being restarted. "
                "Hint: raise timeout_ms in model.toml if the model is legitimately slow"
            ) from None


class _Call:
    __slots__ = ("future", "on_reply")

    def __init__(
        self, future: asyncio.Future[dict[str, Array]], on_reply: Callable[[], None] | None
    ) -> None:
        self.future = future
        self.on_reply = on_reply
