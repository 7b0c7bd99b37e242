"""Triton's system shared memory extension: clients register POSIX shared memory regions
(`shm_open` names) and then name a region, offset and size instead of sending tensor bytes.

A region is mapped read/write only as large as registered (offset + byte_size), checked
against the object's real size first, and unmapped on unregister and at shutdown. POSIX
shared memory objects live under /dev/shm on Linux, the gateway's platform.

The regions are the gateway process's, as Triton's are its server's: one registry per
process (`SYSTEM_SHM`), which the HTTP codec reads tensors from and writes them to.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from infergate.errors import BadRequest
from infergate.tensors import Array, from_wire, to_wire

SHM_ROOT = Path("/dev/shm")
# What shm_open takes: one optional leading slash, then a name without slashes.
_KEY = re.compile(r"^/?[^/\x00]{1,250}$")
# multiprocessing's own names, which the gateway's worker arenas use: never a client's.
_PRIVATE = "psm_"


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    _map: mmap.mmap

    def view(self, offset: int, size: int, what: str) -> memoryview:
        """The bytes [offset, offset + size) of the registered range; 400 past its end."""
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise BadRequest(
                f"{what}: offset {offset} + byte size {size} is past the end of shared memory "
                f"region {self.name!r}, which has {self.byte_size} bytes registered"
            )
        start = self.offset + offset
        return memoryview(self._map)[start : start + size]

    def close(self) -> None:
        # A view still exported: the map goes when it is collected.
        with contextlib.suppress(BufferError):
            self._map.close()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


def _non_negative(value: Any, field: str) -> int:
    if type(value) is not int or value < 0:
        raise BadRequest(f"'{field}' must be a non-negative integer, got {value!r}")
    return value


class SharedMemoryRegions:
    def __init__(self, root: Path = SHM_ROOT) -> None:
        self._root = root
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        if name in self._regions:
            raise BadRequest(
                f"shared memory region {name!r} is already registered. Hint: unregister it "
                "first, or use another name"
            )
        if not isinstance(key, str) or not _KEY.match(key) or key.strip("/") in (".", ".."):
            raise BadRequest(
                f"{key!r} is not a shared memory key; expected a POSIX shm name such as "
                "'/input_simple' (one leading slash, no other)"
            )
        if key.lstrip("/").startswith(_PRIVATE):
            raise BadRequest(
                f"{key!r} names one of the gateway's own segments (Python's psm_ names, "
                "which its worker arenas use); register a region you created"
            )
        offset = _non_negative(offset, "offset")
        byte_size = _non_negative(byte_size, "byte_size")
        if byte_size == 0:
            raise BadRequest("'byte_size' must be positive: a region of 0 bytes holds nothing")
        path = self._root / key.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise BadRequest(
                f"unable to open shared memory region {name!r} with key {key!r}: "
                f"{exc.strerror}. Hint: create it before registering it"
            ) from None
        try:
            actual = os.fstat(fd).st_size
            if offset + byte_size > actual:
                raise BadRequest(
                    f"shared memory region {name!r}: offset {offset} + byte_size {byte_size} "
                    f"is past the end of {key!r}, which is {actual} bytes"
                )
            mapped = mmap.mmap(fd, offset + byte_size)  # read/write, no larger than asked
        finally:
            os.close(fd)
        self._regions[name] = Region(name, key, offset, byte_size, mapped)

    def get(self, name: Any) -> Region:
        region = self._regions.get(name) if isinstance(name, str) else None
        if region is None:
            raise BadRequest(
                f"shared memory region {name!r} is not registered. Hint: register it with "
                "POST /v2/systemsharedmemory/region/<name>/register"
            )
        return region

    def unregister(self, name: str | None) -> None:
        """One region, or every one when `name` is None; an unknown name is a no-op, as
        in Triton (clients unregister everything before they start)."""
        names = list(self._regions) if name is None else [name]
        for each in names:
            region = self._regions.pop(each, None)
            if region is not None:
                region.close()

    def status(self, name: str | None) -> list[dict[str, Any]]:
        if name is None:
            return [r.to_json() for r in self._regions.values()]
        return [self.get(name).to_json()]

    def close_all(self) -> None:
        self.unregister(None)

    def read_input(
        self, input_name: str, datatype: str, shape: tuple[int, ...], params: dict[str, Any]
    ) -> Array:
        """An input whose parameters name a region (copied out: the client may reuse it)."""
        region = self.get(params.get("shared_memory_region"))
        what = f"input {input_name!r}"
        size = _non_negative(params.get("shared_memory_byte_size"), "shared_memory_byte_size")
        offset = _non_negative(params.get("shared_memory_offset", 0), "shared_memory_offset")
        try:
            return from_wire(bytes(region.view(offset, size, what)), datatype, shape)
        except ValueError as exc:
            raise BadRequest(f"{what} in shared memory region {region.name!r} {exc}") from None

    def write_output(self, output_name: str, array: Array, params: dict[str, Any]) -> None:
        """Write an output into the region its parameters name. Its entry in the response
        then has no parameters at all: Triton's C++ client reads any it finds as binary
        data that follows the JSON."""
        region = self.get(params.get("shared_memory_region"))
        size = _non_negative(params.get("shared_memory_byte_size"), "shared_memory_byte_size")
        offset = _non_negative(params.get("shared_memory_offset", 0), "shared_memory_offset")
        blob = to_wire(array)
        if len(blob) > size:
            raise BadRequest(
                f"output {output_name!r} needs {len(blob)} bytes but its shared memory "
                f"byte size is {size}. Hint: register and name a larger range"
            )
        region.view(offset, len(blob), f"output {output_name!r}")[:] = blob


SYSTEM_SHM = SharedMemoryRegions()


def wants_shared_memory(params: Any) -> TypeGuard[dict[str, Any]]:
    return type(params) is dict and "shared_memory_region" in params
