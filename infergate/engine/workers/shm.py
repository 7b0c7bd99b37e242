"""Shared-memory arenas. The gateway creates and unlinks them (so a crashed worker leaks
nothing); a worker maps them by name without registering them with multiprocessing's
resource tracker, which would otherwise unlink the gateway's segment when the worker exits.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from multiprocessing import shared_memory

import numpy as np

from infergate.engine.workers.messages import TensorRef
from infergate.tensors import WIRE_DTYPES, Array, from_wire, to_wire, v2_datatype

ALIGN = 64


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class OwnedArena:
    """An arena created by the gateway; it grows by replacement when a request needs more."""

    def __init__(self, size: int) -> None:
        self._shm = shared_memory.SharedMemory(create=True, size=max(size, ALIGN))
        # Read on every call to its worker; SharedMemory's property works it out each time.
        self.name: str = self._shm.name

    @property
    def size(self) -> int:
        return self._shm.size

    @property
    def buf(self) -> memoryview:
        buf = self._shm.buf
        assert buf is not None
        return buf

    def close(self) -> None:
        self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()


class MappedArena:
    """An arena the gateway made, mapped into a worker."""

    def __init__(self, name: str) -> None:
        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._map)
        self.size = size

    def close(self) -> None:
        self.buf.release()
        self._map.close()


def layout_size(arrays: dict[str, Array]) -> int:
    return sum(aligned(_nbytes(a)) for a in arrays.values())


def _nbytes(array: Array) -> int:
    if array.dtype.kind in ("O", "S", "U"):
        return len(to_wire(array))
    return int(array.nbytes)


def write_tensors(buf: memoryview, arrays: dict[str, Array]) -> tuple[TensorRef, ...]:
    """Copy `arrays` into `buf` one after another; the caller checked the size."""
    refs = []
    offset = 0
    for name, array in arrays.items():
        datatype = v2_datatype(array.dtype)
        if datatype == "BYTES":
            raw = to_wire(array)
            buf[offset : offset + len(raw)] = raw
            nbytes = len(raw)
        else:
            nbytes = int(array.nbytes)
            contiguous = np.ascontiguousarray(array)
            buf[offset : offset + nbytes] = memoryview(contiguous).cast("B")  # type: ignore[arg-type]
        refs.append(TensorRef(name, datatype, tuple(array.shape), offset, nbytes))
        offset += aligned(nbytes)
    return tuple(refs)


def read_tensor(buf: memoryview, ref: TensorRef, copy: bool) -> Array:
    """A view of (or, with copy, a copy out of) the tensor that `ref` points at."""
    dtype = WIRE_DTYPES.get(ref.datatype)
    if dtype is not None and ref.nbytes == math.prod(ref.shape) * dtype.itemsize:
        # Fixed-size elements that fit, as nearly always: straight from the arena, without
        # from_wire's general checks (each end reads one on every request).
        count = ref.nbytes // dtype.itemsize
        fixed = np.frombuffer(buf, dtype, count, ref.offset).reshape(ref.shape)
        return fixed.copy() if copy else fixed
    view = from_wire(buf[ref.offset : ref.offset + ref.nbytes], ref.datatype, ref.shape)
    return view.copy() if copy and view.dtype.kind != "O" else view
