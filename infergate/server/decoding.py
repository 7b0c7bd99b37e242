"""Decoding infer bodies without holding up the event loop.

A small body decodes inline: that is the common case and the fastest. A large one would
hold the loop for as long as it takes (a 60 MB JSON body: about a second on a small
machine), and health checks and every other client would wait behind it. Many bodies
of a megabyte do the same: decoded inline, as they were up to 1 MB, 16 clients of one
tenant sending 1 MB bodies held another tenant's one-row requests at 70 ms (median) behind
their 5 ms parses; decoded here, 5.3 ms. So a body over 256 KB decodes here, where it
costs the loop a copy (0.1 ms a megabyte) instead of the parse; one of 256 KB parses in
about 1.3 ms, and a lone request of 100 KB took 1.5 ms inline against 3.4 ms here.

Threads do not fix that: orjson, numpy's list conversion and pickle hold the GIL for a
whole call (a single 60 MB copy takes 50 ms on a small machine), and a thread running a
Python loop still takes the GIL from the loop every few milliseconds. So the work is
split: a large JSON document is parsed in a helper process (server/decode_helper.py: the
body goes over in a shared-memory segment and the tensors come back in one, copied on an
I/O thread with the GIL released), and what needs Python objects (building the BYTES
elements) runs on the event loop in slices of a few milliseconds, with the loop answering
others between slices. A large binary request has only a small JSON header to parse; its
numbers are views of the body, and its BYTES are built in the same slices.

The helper decodes one body at a time, and the tenants whose bodies wait take turns
(`_Turns`): a tenant that sends many large bodies at once delays another's by at most
one of its own, not by its whole backlog, and only the body being decoded is held in
/dev/shm.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import mmap
import multiprocessing
import os
import secrets
import signal
import sys
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Any, TypeVar

import numpy as np

from infergate import procname
from infergate.errors import BadRequest, InfergateError, TooDeep
from infergate.server.body import free_off_loop
from infergate.server.codec import (
    DEFAULT_MAX_STRINGS,
    Body,
    DecodedRequest,
    _header_length,
    decode_request,
    pass_through_header,
)
from infergate.server.decode_helper import (
    Decoded,
    Raw,
    decode_in_helper,
    pass_through_header_in_helper,
    read_segment,
    unlink_segment,
    write_segment,
)
from infergate.tensors import Array, read_bytes_elements

T = TypeVar("T")
INLINE_MAX_BYTES = 1 << 18  # bodies up to this size decode in one go, on the loop...
_INLINE_TOKENS = 2_000  # ...if they hold at most this many JSON arrays, objects and strings
ALWAYS_INLINE = 4_096  # (a body this small cannot hold more)
_ELEMENTS = 2_000  # BYTES elements built per slice (a few milliseconds)


def json_tokens(json_part: bytes | bytearray) -> int:
    """The brackets, braces and quotes in `json_part`. numpy compares a 20 KB body in 4 µs
    where three bytes.count took 27 µs (a byte a cycle, each): a fifth of the gateway's CPU
    a request at 1,024 JSON numbers. `[` and `{` differ only in the 0x20 bit."""
    data = np.frombuffer(json_part, np.uint8)
    return int(np.count_nonzero((data | 0x20) == ord("{"))) + int(
        np.count_nonzero(data == ord('"'))
    )


class Keeper:
    """What a large request holds, kept until its answer is sent so that it can be let
    go of without holding up the event loop: its body and its tensors' buffers (tens of
    megabytes, freed on the freeing thread, see body.free_off_loop), and its BYTES
    tensors, emptied and freed in slices, as they were built (freeing a million small
    objects at once, or only an array of a million references to them, takes
    milliseconds to tens of milliseconds)."""

    def __init__(self) -> None:
        self._slices: list[list[bytes]] = []
        self._elements: list[Array] = []
        self._buffers: list[Any] = []

    def keep(self, items: list[bytes]) -> None:
        self._slices.append(items)

    def keep_elements(self, flat: Array) -> None:
        """A BYTES tensor's flat object array, to empty in slices once answered."""
        self._elements.append(flat)

    def keep_buffer(self, buffer: Any) -> None:
        """A large body, or an array of one, to free off the loop once answered."""
        self._buffers.append(buffer)

    @property
    def holding(self) -> bool:
        """Whether `release` has anything to do (most requests hold nothing large)."""
        return bool(self._slices or self._elements or self._buffers)

    def free_buffers(self) -> None:
        """Hand the large buffers to the freeing thread now; called even when sending the
        answer failed or was cancelled, or the garbage collector would free them on the loop."""
        if self._buffers:
            held, self._buffers = self._buffers, []
            free_off_loop(held)  # the last references, when the request let go of them

    async def release(self) -> None:
        self.free_buffers()
        while self._elements:
            flat = self._elements.pop()
            if sys.getrefcount(flat) == 2:  # (`flat` and the argument): nobody else's
                for start in range(0, len(flat), _ELEMENTS):
                    flat[start : start + _ELEMENTS].fill(None)
                    await asyncio.sleep(0)
            del flat
        while self._slices:
            self._slices.pop()
            await asyncio.sleep(0)


class _KeepsNothing(Keeper):
    """The keeper of an answer that holds nothing of its request: shared by all such
    answers, so it refuses to keep anything (one request's buffers kept here would be
    every other's, and never let go of)."""

    def keep(self, items: list[bytes]) -> None:
        raise TypeError("KEPT_NOTHING keeps nothing: give the request a Keeper() of its own")

    keep_elements = keep_buffer = keep  # type: ignore[assignment]


# The keeper of an answer that holds nothing of its request (`InferRoute.answer_now`'s, a
# front's): one serves them all (a Keeper and its three lists made for every request were
# a share of its allocations).
KEPT_NOTHING: Keeper = _KeepsNothing()


async def bytes_in_slices(
    name: str, data: memoryview, shape: tuple[int, ...], keeper: Keeper | None = None
) -> Array:
    """A binary BYTES tensor, its elements built a slice at a time."""
    count = math.prod(shape)
    if count * 4 > len(data):  # each element has its 4-byte length: refused before allocating
        raise BadRequest(
            f"input {name!r} holds {len(data)} bytes of binary data, too few for the "
            f"{count} BYTES elements of shape {list(shape)} (each takes at least 4)"
        )
    out = np.empty(count, dtype=object)
    if keeper is not None:
        keeper.keep_elements(out)
    offset = filled = 0
    while offset < len(data):
        try:
            items, offset = read_bytes_elements(data, offset, _ELEMENTS)
        except ValueError as exc:
            raise BadRequest(f"input {name!r} {exc}") from None
        if filled + len(items) > count:
            raise BadRequest(f"input {name!r} holds more BYTES elements than shape {list(shape)}")
        out[filled : filled + len(items)] = items
        filled += len(items)
        if keeper is not None:
            keeper.keep(items)
        await asyncio.sleep(0)
    if filled != count:
        raise BadRequest(
            f"input {name!r} holds {filled} BYTES elements but shape {list(shape)} needs {count}"
        )
    return out.reshape(shape)


async def _tensors_from_raw(raw: Raw, decoded: Decoded, keeper: Keeper | None) -> DecodedRequest:
    inputs: dict[str, Array] = {}
    for t in decoded.tensors:
        value = raw.pop(t.name)
        if isinstance(value, mmap.mmap):
            wire = [value]  # its only reference once split: freed off the loop after
            del value
            view = memoryview(wire[0])[: t.size]
            try:
                inputs[t.name] = await bytes_in_slices(t.name, view, t.shape, keeper)
            finally:
                view.release()
                free_off_loop(wire)
        else:
            if keeper is not None:
                keeper.keep_buffer(value)
            inputs[t.name] = value
    return decoded.request._replace(inputs=inputs)


def _discard(job: Future[Decoded]) -> None:
    if not job.cancelled() and job.exception() is None:
        unlink_segment(job.result().segment)


HELPER_NAME = b"ig-decoder"  # its name in ps and top, apart from the model workers


def _start_helper(gateway: int) -> None:
    os.nice(5)  # the gateway's loop (health, small requests) goes before a big decode
    procname.set_name(HELPER_NAME)
    # Ends with the gateway, however it ends. Without it a killed gateway's helper waited
    # for work for good: it holds both ends of its own queue's pipe, so it never reads an
    # end of file there.
    procname.prctl(procname.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != gateway:  # the gateway was gone before that was set
        os._exit(0)


class _Turns:
    """Who goes next in the helper: one body at a time, the tenants that wait in turn
    (round robin: each tenant's own bodies in arrival order)."""

    def __init__(self) -> None:
        self._holder: Hashable = None
        self._held = False
        self._waiting: dict[Hashable, deque[asyncio.Future[None]]] = {}  # in turn order

    async def take(self, tenant: Hashable) -> None:
        """Wait for `tenant`'s turn; the caller must `give` it back."""
        if not self._held:
            self._held, self._holder = True, tenant
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give()  # it was given this turn as it gave up: the next one's
            else:
                queue = self._waiting.get(tenant)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del self._waiting[tenant]
            raise

    def give(self) -> None:
        """The turn is over: the next tenant that waits (not the one that just went,
        while another waits) gets it."""
        waiting = self._waiting
        if len(waiting) > 1 and next(iter(waiting)) == self._holder:
            waiting[self._holder] = waiting.pop(self._holder)  # to the back of the line
        while waiting:
            tenant = next(iter(waiting))
            queue = waiting.pop(tenant)
            turn = queue.popleft()
            if queue:
                waiting[tenant] = queue  # its next body waits for the others' turns
            if not turn.done():
                self._holder = tenant
                turn.set_result(None)
                return
        self._held = False


def _give_back(loop: asyncio.AbstractEventLoop, turns: _Turns, job: Future[Any]) -> None:
    """A job whose caller gave up is done: its turn is over (called on a helper thread)."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: the gateway has stopped
        loop.call_soon_threadsafe(turns.give)


class BodyDecoder:
    def __init__(
        self, inline_max_bytes: int = INLINE_MAX_BYTES, max_strings: int = DEFAULT_MAX_STRINGS
    ) -> None:
        self._inline_max = inline_max_bytes
        self.max_strings = max_strings  # BYTES elements a request may hold (codec)
        self._pool: ProcessPoolExecutor | None = None
        self._io: ThreadPoolExecutor | None = None
        self._turns = _Turns()

    def inline(self, body: Body, header_length: str | None = None) -> bool:
        """Whether `decode` decodes `body` on the spot (its caller may then call
        `codec.decode_request` itself, without a coroutine): a small body, whose JSON
        holds few arrays and strings. What a byte of JSON costs to decode varies 30 times
        over: a flat list of numbers 1-3 ms for 250 KB, nested rows (`[[0],[0],...]`),
        strings or empty objects 26-42 ms for 170-250 KB (a 343-byte gzip body of `{}`s
        held the loop 35 ms), which one client sending such bodies (to be refused, even,
        after decoding) held every tenant's requests behind. Counting the brackets, braces
        and quotes (json_tokens) says which."""
        size = len(body)
        if size > self._inline_max:
            return False
        if size <= ALWAYS_INLINE:
            return True
        if isinstance(body, memoryview):
            return False
        json_part = body
        if header_length is not None and header_length.isdigit():
            json_part = body[: int(header_length)]  # the binary tensors after it: not JSON
        return json_tokens(json_part) <= _INLINE_TOKENS

    async def decode(
        self,
        body: Body,
        header_length: str | None,
        keeper: Keeper | None = None,
        tenant: Hashable = None,
    ) -> DecodedRequest:
        """The request in `body`; `tenant`: whose it is, for its turn in the helper."""
        if self.inline(body, header_length):
            return decode_request(body, header_length, max_strings=self.max_strings)
        if keeper is not None:
            keeper.keep_buffer(body)  # the request's own reference goes first
        if header_length is not None:  # its 400 before any decoding, on the loop or not
            _header_length(header_length, len(body))
        if not self._json_heavy(header_length):  # a small JSON header, then binary tensors
            decoded = decode_request(
                body, header_length, defer_bytes=True, max_strings=self.max_strings
            )
            if not decoded.deferred:
                return decoded
            inputs = dict(decoded.inputs)
            for name, (data, shape) in decoded.deferred.items():
                inputs[name] = await bytes_in_slices(name, data, shape, keeper)
            return decoded._replace(inputs=inputs, deferred=None)
        return await self._in_helper(body, header_length, keeper, tenant)

    def _json_heavy(self, header_length: str | None) -> bool:
        """Whether a large body's JSON is large too: all of it (no binary header length),
        or a header longer than what decodes inline."""
        # (Its callers checked it: digits, at most the body's length.)
        return header_length is None or int(header_length) > self._inline_max

    async def pass_through_header(
        self, body: Body, header_length: str | None, tenant: Hashable = None
    ) -> dict[str, Any] | None:
        """`codec.pass_through_header` (a remote model's request header), in the helper
        when the JSON to parse is large: parsed on the loop, 60 MB of JSON numbers held
        every tenant's requests for 0.74 s."""
        if header_length is not None:  # a length past the body is a 400 here, not there
            _header_length(header_length, len(body))
        if len(body) <= self._inline_max or not self._json_heavy(header_length):
            return pass_through_header(body, header_length)
        call = partial(pass_through_header_in_helper, max_strings=self.max_strings)
        return await self._call_helper(body, call, header_length, None, tenant)

    async def _in_helper(
        self, body: Body, header_length: str | None, keeper: Keeper | None, tenant: Hashable
    ) -> DecodedRequest:
        call = partial(decode_in_helper, max_strings=self.max_strings)
        try:
            decoded = await self._call_helper(body, call, header_length, _discard, tenant)
        except TooDeep:
            if len(body) > self._inline_max:
                raise BadRequest(
                    "the request's JSON nests too deep to decode a body this large; send "
                    "parameters nested at most a few hundred levels"
                ) from None
            return decode_request(body, header_length, max_strings=self.max_strings)
        # The read unlinks the helper's segment whether or not this request is still
        # waiting for it; a read cancelled before it ran (its client left) does not, so the
        # unlink goes after it on the one I/O thread.
        reading = self._io_thread().submit(read_segment, decoded)
        try:
            raw = await asyncio.wrap_future(reading)
        except asyncio.CancelledError:
            self._io_thread().submit(unlink_segment, decoded.segment)
            raise
        return await _tensors_from_raw(raw, decoded, keeper)

    async def _call_helper(
        self,
        body: Body,
        call: Callable[[str, int, str | None], T],
        header_length: str | None,
        on_cancel: Callable[[Future[T]], None] | None,
        tenant: Hashable = None,
    ) -> T:
        """`call(segment, size, header_length)` in the helper, in `tenant`'s turn, the body
        handed over in a shared-memory segment written and unlinked on the I/O thread.
        `on_cancel` gets the job when the caller gives up before it is done (to release
        what it makes); the turn then ends when the job does, so that a tenant whose
        clients give up cannot fill the helper's queue ahead of the others."""
        await self._turns.take(tenant)
        held = True  # the turn is given back below, unless the helper still runs the job
        segment = f"infergate-body-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            await asyncio.wrap_future(self._io_thread().submit(write_segment, segment, body))
            try:
                job = self._helper().submit(call, segment, len(body), header_length)
            except OSError as exc:  # the helper could not start (EAGAIN, EMFILE, ENOMEM)
                self.close_helper()
                raise InfergateError(
                    f"the body decoder process could not start ({exc.strerror or exc}); "
                    "retry the request"
                ) from None
            try:
                return await asyncio.wrap_future(job)
            except asyncio.CancelledError:
                if on_cancel is not None:
                    job.add_done_callback(on_cancel)  # what it makes, when it comes
                if not job.done():
                    held = False
                    job.add_done_callback(
                        partial(_give_back, asyncio.get_running_loop(), self._turns)
                    )
                raise
        except BrokenProcessPool:
            self._pool = None  # a new helper for the next large body
            raise InfergateError("the body decoder process died; retry the request") from None
        finally:
            # Freeing its pages takes a while: not here.
            self._io_thread().submit(unlink_segment, segment)
            if held:
                self._turns.give()

    def _io_thread(self) -> ThreadPoolExecutor:
        if self._io is None:
            # One thread, so that jobs run in the order given: an unlink queued after a
            # write (a request cancelled while its body is written) finds the file there.
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ig-decode-io")
        return self._io

    def _helper(self) -> ProcessPoolExecutor:
        """The helper, started by the first large JSON body, not at the gateway's start:
        a spawned interpreter that imports numpy costs 0.25 s of CPU and 50 MB of memory,
        which most gateways (binary tensors, small JSON bodies) never need. That first
        body waits for it (about 0.2 s more on an idle machine); a 60 MB one takes a
        second to decode anyway."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_helper,
                initargs=(os.getpid(),),
            )
        return self._pool

    def close_helper(self) -> None:
        """Stop the helper (a new one starts with the next large body)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        self.close_helper()
        if self._io is not None:
            self._io.shutdown(wait=True)  # what it has queued: unlinks, which must happen
            self._io = None
