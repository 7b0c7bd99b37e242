"""multiprocessing.Connection's framing on a worker's pipe, without Connection's Python
layers: a "!i" length (or -1 then a "!Q" length) and then the bytes. The gateway's end of
the pipe is non-blocking (uvloop makes it so whatever the loop), so `Frames` reads what
is there and cuts whole frames out of it; the worker's end stays a plain Connection.
"""

from __future__ import annotations

import mmap
import os
import struct

_READ = 1 << 20  # bytes asked of the pipe per read
_HEAD = struct.Struct("!i")


class Frames:
    """multiprocessing.Connection's framing (a "!i" length, or -1 then a "!Q" length,
    then the bytes), read from a non-blocking fd as the bytes come."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()
        # Read into one buffer kept for the pipe's life: os.read(fd, 1 MiB) allocates (and
        # the allocator maps and unmaps) 1 MiB per reply, 30 µs of a tiny request's 180.
        # An anonymous mapping, not a bytearray (which zero-fills all of it): only the
        # pages reads reach are ever resident, one for a small reply.
        self._chunk = mmap.mmap(-1, _READ)
        self._view = memoryview(self._chunk)

    def read(self) -> tuple[list[bytes], bool]:
        """The whole frames that arrived, and whether the other end closed."""
        eof = False
        while True:
            try:
                n = os.readv(self._fd, [self._chunk])
            except BlockingIOError:
                break
            if not n:
                eof = True
                break
            if not self._buf and n < _READ and n >= 4:
                (size,) = _HEAD.unpack_from(self._chunk)
                if size + 4 == n:  # one whole frame, as a reply nearly always is
                    return [bytes(self._view[4:n])], False
            self._buf += self._view[:n]
            if n < _READ:
                break  # drained; the loop calls again when more comes
        return self._cut(), eof

    def _cut(self) -> list[bytes]:
        buf, pos, frames = self._buf, 0, []
        with memoryview(buf) as view:
            while len(buf) - pos >= 4:
                (size,) = struct.unpack_from("!i", buf, pos)
                head = 4
                if size == -1:
                    if len(buf) - pos < 12:
                        break
                    (size,) = struct.unpack_from("!Q", buf, pos + 4)
                    head = 12
                if len(buf) - pos - head < size:
                    break
                frames.append(bytes(view[pos + head : pos + head + size]))
                pos += head + size
        if pos:
            del buf[:pos]
        return frames


def send_frame(fd: int, payload: bytes) -> None:
    """`Connection.send_bytes`, written straight to the fd: the same frame
    (a "!i" length, then the bytes; a call is a few hundred bytes) without the five Python
    frames multiprocessing goes through per send, on every batch's way to its worker."""
    frame = _HEAD.pack(len(payload)) + payload
    while frame:
        frame = frame[os.write(fd, frame) :]
