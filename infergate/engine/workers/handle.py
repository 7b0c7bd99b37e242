"""One worker process as the gateway's event loop sees it.

Replies are futures keyed by call id, read off the pipe by a loop reader (no threads);
when the pipe hits EOF the worker is exiting and every future it held fails once it has
exited, which the loop learns from its pidfd (readable once the process is dead; never a
blocking join), and how from the fork server's report on the process's sentinel. Not from
the sentinel alone: it also reads ready when the fork server dies, worker alive or not.

The pipe is read without blocking, whatever the loop (uvloop makes the fd non-blocking
anyway): `frames.Frames` reads what is there and cuts multiprocessing's frames out of it,
so a reply of any size arrives in pieces without stalling the loop or being taken for EOF.

A call is sent synchronously (`begin`) and awaited separately (`wait`), and whoever sends
it may pass `on_reply`, which runs inside the pipe reader the moment the reply is read,
before any task wakes: the scheduler hands the worker its next batch from there, so the
worker does not sit idle while the event loop works through other callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from infergate.engine.workers import forking, starting
from infergate.engine.workers.frames import Frames, send_frame
from infergate.engine.workers.messages import (
    InferCall,
    InferDone,
    InferFailed,
    LoadFailed,
    Ready,
    Stop,
    TensorRef,
    WorkerSpec,
    decode,
    encode,
)
from infergate.engine.workers.shm import OwnedArena, layout_size, read_tensor, write_tensors
from infergate.engine.workers.worker import worker_main
from infergate.errors import (
    DataNotServable,
    DeadlineExceeded,
    ModelExecutionError,
    SharedMemoryUnavailable,
    WorkerFailed,
    WorkerOverMemory,
)
from infergate.errors import WorkerLoadError as WorkerLoadError  # raised here
from infergate.errors import WorkerStartError as WorkerStartError  # raised here
from infergate.tensors import Array, from_wire

log = logging.getLogger("infergate.workers")
INITIAL_ARENA = 1 << 20
_LINGER_S = 5.0  # a worker whose pipe closed but which has not exited is killed after this
# A healthy fork server forks a worker, or reports a dead one's exit, within milliseconds;
# one that has not in this long is hung and is killed (starting.kill_hung).
_FORK_ANSWER_S = 5.0
_FORK_REPORT_S = 3.0


class WorkerHandle:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._ids = itertools.count(1)
        self._pending: dict[int, _Call] = {}
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Ready] = self._loop.create_future()
        self.exited: asyncio.Future[None] = self._loop.create_future()
        self._in: OwnedArena | None = None
        self._out: OwnedArena | None = None
        self._conn: Connection | None = None
        self._frames: Frames | None = None
        self._process: BaseProcess | None = None
        self._pid: int | None = None
        self._pidfd: int | None = None
        self._by_pid = True  # without a pidfd: signal by pid (only where there are none)
        self._server: int | None = None  # the fork server that started it
        self._reaping = False
        self._linger: asyncio.TimerHandle | None = None
        self._unreported: asyncio.TimerHandle | None = None  # see _report_overdue
        self.death_reason = "the worker exited"
        self.over_memory = False
        self._copying = 0  # copies of large outputs running on the copier (_copy_off_loop)
        self._arenas_closing = False  # the arenas close once they end

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    async def start(self, timeout_s: float) -> Ready:
        """Start the process and wait until its model is loaded and warmed up. Raises
        WorkerStartError when the process could not even be started (nothing is left
        open), WorkerLoadError when it started and did not load."""
        deadline = self._loop.time() + timeout_s
        try:
            await asyncio.wait_for(starting.ready(), timeout_s)
            # Within the load timeout, and leaving time to try again with a new fork server.
            await self._launch(min(_FORK_ANSWER_S, timeout_s / 2))
        except TimeoutError:
            self._discard()
            raise WorkerStartError(
                f"the fork server did not start within the {timeout_s:.0f} s load timeout"
            ) from None
        except WorkerStartError:
            self._discard()
            raise
        except Exception as exc:
            self._discard()
            raise WorkerStartError(f"{type(exc).__name__}: {exc}") from exc
        try:
            left = max(0.0, deadline - self._loop.time())
            return await asyncio.wait_for(asyncio.shield(self._ready), left)
        except TimeoutError:
            self.kill(f"it did not finish loading within {timeout_s:.0f} s")
            raise WorkerLoadError(
                f"loading took longer than {timeout_s:.0f} s. Hint: raise load_timeout_s in "
                "the profile's [server] if the model is legitimately slow to load"
            ) from None

    async def _launch(self, answer_s: float) -> None:
        self._in = OwnedArena(INITIAL_ARENA)
        self._out = OwnedArena(INITIAL_ARENA)
        starting.ensure_server()
        self._server = starting.server_pid()
        context = starting.context()
        self._conn, child = context.Pipe(duplex=True)
        try:
            self._process = context.Process(
                target=worker_main,
                # The environment as it is now: the fork server's is that of its own start.
                args=(child, self.spec, dict(os.environ), starting.lifeline()),
                name=f"infergate-worker:{self.spec.model}:{self.spec.version}",
                daemon=True,
            )
        except BaseException:
            child.close()
            raise
        # From here the fork's thread owns `child` and closes it.
        self._server = await forking.fork(self._process, child, answer_s, self._discard)
        self._pid = self._process.pid
        self._open_pidfd()
        fd = self._conn.fileno()
        os.set_blocking(fd, False)
        self._frames = Frames(fd)
        self._loop.add_reader(fd, self._on_readable)

    def _discard(self) -> None:
        """Release what a failed start had opened."""
        for arena in (self._in, self._out):
            if arena is not None:
                arena.close()
        if self._conn is not None:
            self._conn.close()
        if self._process is not None and self._process.pid is not None:
            with contextlib.suppress(Exception):
                self._process.kill()
                self._process.join(1.0)
        self._close_pidfd()
        if not self.exited.done():
            self.exited.set_result(None)

    def _on_readable(self) -> None:
        assert self._frames is not None
        try:
            frames, eof = self._frames.read()
            for frame in frames:
                self._dispatch(decode(frame))
        except (EOFError, OSError):
            eof = True
        if eof:
            self._on_eof()

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
            if (
                isinstance(message, InferDone)
                and message.inline is None
                and not call.future.done()
                and sum(r.nbytes for r in message.outputs) > COPY_HERE_BYTES
            ):
                self._copy_off_loop(call, message)
                return
            if not call.future.done():
                try:
                    outputs = self._outputs(message)
                except (ModelExecutionError, DataNotServable) as exc:
                    call.fail(exc)
                else:
                    call.succeed(outputs)
            self._replied(call)

    def _replied(self, call: _Call) -> None:
        """The call's `on_reply`, now that its outputs are out of the arena."""
        if call.on_reply is not None:
            try:
                call.on_reply()
            except Exception:  # a bug there must not stop this pipe being read
                log.exception("worker pid %s: reply hook failed", self.pid)

    def _copy_off_loop(self, call: _Call, reply: InferDone) -> None:
        """Large outputs copied out of the arena on a thread (numpy's copy lets go of the
        GIL); the call is answered, and its `on_reply` run, once they are. Until then no
        other call is sent to this worker (its instance waits for this one), so the arena
        is not reused, and an exit does not close it under the copy (`_close_arenas`)."""
        assert self._out is not None
        self._copying += 1
        job = _copier().submit(_copy_out, self._out.buf, reply.outputs)
        loop = self._loop

        def copied(job: Future[dict[str, Array]]) -> None:  # on the copying thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: the gateway stopped
                loop.call_soon_threadsafe(self._copied, call, job)

        job.add_done_callback(copied)

    def _copied(self, call: _Call, job: Future[dict[str, Array]]) -> None:
        self._copying -= 1
        if not self._copying and self._arenas_closing:
            self._close_arenas()
        if not call.future.done():
            error = job.exception()
            if error is None:
                call.succeed(job.result())
            else:
                call.fail(error)
        self._replied(call)

    def _close_arenas(self) -> None:
        """Close both arenas, or once the copy out of them that runs is done."""
        if self._copying:
            self._arenas_closing = True
            return
        self._arenas_closing = False
        for arena in (self._in, self._out):
            if arena is not None:
                arena.close()

    def _outputs(self, reply: InferDone | InferFailed) -> dict[str, Array]:
        """The reply's tensors, copied out of the arena before the next call can reuse it."""
        if isinstance(reply, InferFailed):
            if reply.request_fault:
                raise DataNotServable(
                    f"model {self.spec.model!r} version {self.spec.version} cannot serve "
                    f"this request's data: {reply.reason.partition(': ')[2]}"
                )
            raise ModelExecutionError(
                f"model {self.spec.model!r} version {self.spec.version} failed: {reply.reason}"
            )
        assert self._out is not None
        if reply.inline is not None:
            try:  # next time the outputs fit; if the system says no, they come inline again
                grown = OwnedArena(reply.needed * 2)
            except OSError as exc:
                log.warning("worker pid %s: output arena not grown: %s", self.pid, exc)
            else:
                self._out.close()
                self._out = grown
            return {
                r.name: from_wire(reply.inline[r.name], r.datatype, r.shape) for r in reply.outputs
            }
        return {r.name: read_tensor(self._out.buf, r, copy=True) for r in reply.outputs}

    def _on_eof(self) -> None:
        """The pipe closed: the worker is exiting. Wait for its sentinel to learn how."""
        if self._reaping or self.exited.done():
            return
        self._reaping = True
        assert self._conn is not None
        assert self._process is not None
        self._loop.remove_reader(self._conn.fileno())
        self._conn.close()
        if self._pidfd is not None:
            self._loop.add_reader(self._pidfd, self._on_dead)
        else:  # which also reads ready when the fork server dies
            self._loop.add_reader(self._process.sentinel, self._on_exit)
        self._linger = self._loop.call_later(_LINGER_S, self._kill_lingering)

    def _kill_lingering(self) -> None:
        if self._process is not None and not self.exited.done():
            self.kill(f"it closed its pipe but did not exit within {_LINGER_S:.0f} s")

    def _on_dead(self) -> None:
        """Its pidfd read ready: the worker has exited. How, the fork server reports on the
        sentinel once it has reaped it (the sentinel reads EOF instead if it died)."""
        assert self._pidfd is not None
        assert self._process is not None
        self._loop.remove_reader(self._pidfd)
        if not self.exited.done():
            self._loop.add_reader(self._process.sentinel, self._on_exit)
            self._unreported = self._loop.call_later(_FORK_REPORT_S, self._report_overdue)

    def _report_overdue(self) -> None:
        """Dead for a while, and the fork server has not said how: it is hung. Killed, it
        can no longer hold this worker's end (its sentinel reads EOF, `_on_exit` runs)."""
        if not self.exited.done():
            why = f"worker pid {self.pid} exited {_FORK_REPORT_S:.0f} s ago, still unreported"
            starting.kill_hung(self._server, why)

    def _on_exit(self) -> None:
        if self.exited.done():
            return
        assert self._process is not None
        self._loop.remove_reader(self._process.sentinel)
        self._process.join(0)  # never blocks
        code = self._process.exitcode
        if code is None:
            # The kernel closes a dying process's fds a moment before it can be reaped.
            self._loop.call_later(0.002, self._on_exit)
            return
        for timer in (self._linger, self._unreported):
            if timer is not None:
                timer.cancel()
        self._process.close()  # its pipe fds now, not at some later garbage collection
        self._close_pidfd()
        if code == 255 and starting.is_gone(self._server):
            # multiprocessing's 255: the fork server died before it could report.
            how = "is gone (how it ended is unknown: the fork server that started it died)"
        elif code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
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
                call.fail(error)
        self._pending.clear()
        self._close_arenas()
        self.exited.set_result(None)

    def kill_over_memory(self, why: str) -> None:
        self.over_memory = True
        self.kill(why)

    def kill(self, why: str) -> None:
        """SIGKILL the worker; its futures fail once the sentinel says it is gone."""
        self.death_reason = f"worker pid {self.pid} was killed: {why}"
        if self._process is None or self.exited.done() or self._pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:  # this process, even if its pid was reused since
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif self._by_pid:  # no pidfds here at all
                os.kill(self._pid, signal.SIGKILL)

    def _open_pidfd(self) -> None:
        """A handle on the process itself: the fork server, not the gateway, reaps a
        worker, so by the time the gateway kills it its pid may already name another
        process. Only where pidfds are not supported is the pid used instead: a worker
        gone already is never signalled (its pid may be another's)."""
        if self._pid is None:
            return
        try:
            self._pidfd = os.pidfd_open(self._pid)
        except AttributeError:  # not Linux
            return
        except ProcessLookupError:  # exited already: its sentinel tells how
            self._by_pid = False
        except OSError as exc:
            if exc.errno != errno.ENOSYS:  # a kernel before 5.3 kills by pid
                raise

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask the worker to exit after its current call; kill it if it does not."""
        if not self.alive:
            return
        if self._process is None:  # never started
            self.exited.set_result(None)
            return
        if self._conn is not None and not self._reaping:
            with contextlib.suppress(OSError):
                self._conn.send_bytes(encode(Stop()))
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), grace_s)
        except TimeoutError:
            why = f"it did not stop within {grace_s:g} s"
            model, pid = self.spec.model, self.pid
            log.warning("model %s: worker pid %s killed at stop: %s", model, pid, why)
            self.kill(why)
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
        assert self._in is not None
        assert self._out is not None
        assert self._conn is not None
        needed = layout_size(inputs)
        if needed > self._in.size:
            try:  # the new arena first: if the system says no, the old one still serves
                grown = OwnedArena(needed * 2)
            except OSError as exc:
                raise SharedMemoryUnavailable(
                    f"model {self.spec.model!r}: this request needs {needed * 2 / 2**20:.0f} MB "
                    f"of shared memory and the system refused it ({exc}). Hint: retry later "
                    "or send a smaller batch; /dev/shm may be full or limited"
                ) from None
            self._in.close()
            self._in = grown
        refs = write_tensors(self._in.buf, inputs)
        call = InferCall(
            next(self._ids), self._in.name, self._out.name, self._out.size, refs, tuple(outputs)
        )
        future: asyncio.Future[dict[str, Array]] = self._loop.create_future()
        self._pending[call.id] = _Call(future, on_reply)
        send_frame(self._conn.fileno(), encode(call))
        return future

    def _mirror(self, call: asyncio.Future[dict[str, Array]]) -> asyncio.Future[dict[str, Array]]:
        """A future settled with `call` (one from `begin`) when its reply is read: `call`
        itself once it is settled, else a new mirror on its pending call (replacing any
        earlier one: a caller that gave up no longer awaits it)."""
        if call.done():
            return call
        for pending in self._pending.values():  # at most one call is in flight
            if pending.future is call:
                pending.mirror = self._loop.create_future()
                return pending.mirror
        return asyncio.shield(call)  # not this worker's call: settled only through it

    async def wait(
        self,
        call: asyncio.Future[dict[str, Array]],
        timeout_s: float,
        limit_s: float | None = None,
    ) -> dict[str, Array]:
        """The outputs of a call `begin` sent (its future); a call past `timeout_s` kills
        the worker. `limit_s`: the execution timeout to name (the call may have started
        earlier). A caller that gives up (its task is cancelled) leaves the call's own
        future alone: another may still await it.

        A timer and a plain await, not asyncio.wait_for, which adds a waiter future and a
        turn of the event loop between the reply and its caller; and the caller awaits a
        mirror of the call's future that the reply settles at the same moment, not
        `asyncio.shield(call)`, which settles its own future a turn later (a lone
        request's reply waited two turns of the loop to reach its caller, now one)."""
        future = self._mirror(call)
        if not future.done():
            expired = False

            def expire() -> None:
                nonlocal expired
                expired = future.cancel()

            timer = self._loop.call_later(max(0.0, timeout_s), expire)
            try:
                await future
            except asyncio.CancelledError:
                # Task.cancelling() is Python 3.11's; on 3.10 a caller's cancel in the
                # very turn the timer fires reads as the timeout.
                cancelling = getattr(asyncio.current_task(), "cancelling", None)
                if not expired or (cancelling is not None and cancelling()):
                    raise  # the caller gave up (even as the timer fired): not a timeout
            finally:
                timer.cancel()
            if not expired:
                return future.result()
            limit_ms = (timeout_s if limit_s is None else limit_s) * 1000
            self.kill(f"a request ran past the execution timeout of {limit_ms:.0f} ms")
            raise DeadlineExceeded(
                f"model {self.spec.model!r} version {self.spec.version} did not answer within "
                f"{limit_ms:.0f} ms; its worker was killed and is being restarted. "
                "Hint: raise timeout_ms in model.toml if the model is legitimately slow"
            )
        return future.result()


# Outputs up to this size are copied out of the arena in the pipe reader, on the loop (a
# few hundred microseconds at most); larger ones on a thread: 60 MB took the loop 40 to
# 900 ms (the copy's page faults), while every other client waited.
COPY_HERE_BYTES = 4 << 20


@functools.cache
def _copier() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="ig-outputs")


def _copy_out(buf: memoryview, refs: tuple[TensorRef, ...]) -> dict[str, Array]:
    """On the copier's thread: the outputs `refs` point at, copied out of the arena."""
    return {r.name: read_tensor(buf, r, copy=True) for r in refs}


class _Call:
    __slots__ = ("future", "on_reply", "mirror")

    def __init__(
        self, future: asyncio.Future[dict[str, Array]], on_reply: Callable[[], None] | None
    ) -> None:
        self.future = future
        self.on_reply = on_reply
        self.mirror: asyncio.Future[dict[str, Array]] | None = None  # what `wait` awaits

    def succeed(self, outputs: dict[str, Array]) -> None:
        self.future.set_result(outputs)
        if self.mirror is not None and not self.mirror.done():
            self.mirror.set_result(outputs)

    def fail(self, error: BaseException) -> None:
        self.future.set_exception(error)
        if self.mirror is not None and not self.mirror.done():
            self.mirror.set_exception(error)
            self.future.exception()  # read where its mirror is awaited: never "unretrieved"
