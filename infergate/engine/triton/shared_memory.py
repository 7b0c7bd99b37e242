"""Triton's system shared memory extension: clients register POSIX shared memory regions
(`shm_open` names) and then name a region, offset and size instead of sending tensor bytes.

A region is a descriptor held open from register to unregister (and shutdown), checked
against the object's real size when registered. It is read and written with pread and
pwrite, never mapped: the client owns the object and may shrink it at any time, and a
mapped page past a file's end kills the process with SIGBUS, while a short pread is only
a short read (a 400 that says to register the region again). POSIX shared memory objects
live under /dev/shm on Linux, the gateway's platform.

The regions are the gateway process's, as Triton's are its server's: one registry per
process (`SYSTEM_SHM`), which the HTTP codec reads tensors from and writes them to.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from infergate.errors import BadRequest, PayloadTooLarge, shown
from infergate.tensors import Array, from_wire, to_wire

SHM_ROOT = Path("/dev/shm")
# What shm_open takes: one optional leading slash, then a name without slashes.
_KEY = re.compile(r"^/?[^/\x00]{1,250}$")
# What the body decoder's segments are named by (server/decode_helper.py).
DECODE_SEGMENT_PREFIX = "infergate-decode-"
# The gateway's own segments, never a client's: multiprocessing's names (the workers'
# arenas), and the body decoder's (server/decode_helper.py: other tenants' request bodies).
_PRIVATE = ("psm_", DECODE_SEGMENT_PREFIX)
MAX_NAME_CHARS = 256  # a region's name: each is listed in every status answer
# Each region holds a descriptor open: bounded, so that clients cannot take the ones the
# gateway keeps for its own work (cli/serve.py's reserve of 256).
MAX_REGIONS = 128
# The largest file offset (off_t): pread and pwrite take no more, and no object is larger.
_MAX_OFFSET = 2**63 - 1
_SHRUNK = "its object is now shorter than the registered range"


class _Tensor(NamedTuple):
    """The input or output a region is read or written for, as an error message names it:
    put into words only for an error (shown() costs a microsecond a call)."""

    kind: str  # "input" or "output"
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {shown(self.name)}"


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    _fd: int

    def read(self, offset: int, size: int, what: _Tensor) -> bytes:
        """The bytes [offset, offset + size) of the registered range (a copy: the client
        may reuse the region as soon as it has its answer)."""
        start = self._start(offset, size, what)
        try:
            data = os.pread(self._fd, size, start)
        except OSError as exc:
            raise self._unusable(what, exc.strerror) from None
        if len(data) < size:
            raise self._unusable(what, _SHRUNK)
        return data

    def write(self, offset: int, blob: bytes, what: _Tensor) -> None:
        start = self._start(offset, len(blob), what)
        # pwrite past the end would grow the object rather than fail: refuse a shrunk one.
        try:
            if os.fstat(self._fd).st_size < start + len(blob):
                raise self._unusable(what, _SHRUNK)
            written = os.pwrite(self._fd, blob, start)
        except OSError as exc:
            raise self._unusable(what, exc.strerror) from None
        if written < len(blob):
            raise self._unusable(what, f"only {written} of {len(blob)} bytes were written")

    def _start(self, offset: int, size: int, what: _Tensor) -> int:
        """Where [offset, offset + size) of the registered range starts in the object;
        400 past the range's end."""
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise BadRequest(
                f"{what}: offset {offset} + byte size {size} is past the end of shared memory "
                f"region {shown(self.name)}, which has {self.byte_size} bytes registered"
            )
        return self.offset + offset

    def _unusable(self, what: _Tensor, why: str | None) -> BadRequest:
        return BadRequest(
            f"{what}: shared memory region {shown(self.name)} (key {shown(self.key)}) can no "
            f"longer be used: {why}. Hint: unregister the region, then register it again "
            "once its object holds offset + byte_size bytes"
        )

    def close(self) -> None:
        os.close(self._fd)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


def _non_negative(value: Any, field: str) -> int:
    if type(value) is int and 0 <= value <= _MAX_OFFSET:
        return value
    raise BadRequest(f"'{field}' must be an integer from 0 to 2**63 - 1, got {shown(value)}")


class SharedMemoryRegions:
    def __init__(self, root: Path = SHM_ROOT) -> None:
        self._root = root
        self._regions: dict[str, Region] = {}
        # An input is copied out of its region on the event loop, as a body would be read:
        # it may be no larger than a body (the gateway sets max_request_mb's bytes). A
        # 156-byte request read 512 MB before its rows were refused, and held the loop 1.5 s.
        self.max_input_bytes: int | None = None

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        if len(name) > MAX_NAME_CHARS:
            raise BadRequest(
                f"a shared memory region's name has at most {MAX_NAME_CHARS} characters, "
                f"got {len(name)}. Hint: name it shortly"
            )
        if name in self._regions:
            raise BadRequest(
                f"shared memory region {shown(name)} is already registered. Hint: unregister "
                "it first, or use another name"
            )
        if len(self._regions) >= MAX_REGIONS:
            raise BadRequest(
                f"{MAX_REGIONS} shared memory regions are registered, the most the gateway "
                "holds. Hint: unregister the regions no longer in use"
            )
        key = _key(key)
        offset = _non_negative(offset, "offset")
        byte_size = _non_negative(byte_size, "byte_size")
        if byte_size == 0:
            raise BadRequest("'byte_size' must be positive: a region of 0 bytes holds nothing")
        fd = self._open(name, key)
        try:
            _check_size(fd, name, key, offset, byte_size)
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd)

    def _open(self, name: str, key: str) -> int:
        # O_NOFOLLOW, as shm_open itself opens: a link in /dev/shm names no region.
        try:
            return os.open(self._root / key.lstrip("/"), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise BadRequest(
                f"unable to open shared memory region {shown(name)} with key {shown(key)}: "
                f"{exc.strerror}. Hint: create it before registering it"
            ) from None

    def get(self, name: Any) -> Region:
        if not isinstance(name, str):
            raise BadRequest(
                f"'shared_memory_region' must be the name of a registered region (a string), "
                f"got {shown(name)}"
            )
        region = self._regions.get(name)
        if region is None:
            raise BadRequest(
                f"shared memory region {shown(name)} is not registered. Hint: register it "
                "with POST /v2/systemsharedmemory/region/<name>/register"
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
        self,
        input_name: str,
        datatype: str,
        shape: tuple[int, ...],
        params: dict[str, Any],
        read_before: int = 0,
    ) -> tuple[Array, int]:
        """An input whose parameters name a region, and the bytes it took from it.
        `read_before`: what the request's inputs before it took (the limit is the whole
        request's: 64 inputs naming one 8 MB region read 512 MB)."""
        region = self.get(params.get("shared_memory_region"))
        what = _Tensor("input", input_name)
        size = _non_negative(params.get("shared_memory_byte_size"), "shared_memory_byte_size")
        offset = _non_negative(params.get("shared_memory_offset", 0), "shared_memory_offset")
        if self.max_input_bytes is not None and read_before + size > self.max_input_bytes:
            raise PayloadTooLarge(
                f"{what} names {size} bytes of shared memory region {shown(region.name)}, "
                f"bringing the request's to {read_before + size}, over the "
                f"{self.max_input_bytes / 2**20:g} MB a request may bring. Hint: send "
                "smaller batches or raise max_request_mb in the profile's [server] table"
            )
        try:
            return from_wire(region.read(offset, size, what), datatype, shape), size
        except ValueError as exc:
            raise BadRequest(f"{what} in shared memory region {shown(region.name)} {exc}") from None

    def check_output(self, output_name: str, params: dict[str, Any]) -> None:
        """400 now, before the model runs, for an output's shared memory parameters that
        `write_output` would refuse whatever the output holds: an unregistered region,
        a size or offset that is not one, a range past the region's end."""
        self._output_range(output_name, params)

    def _output_range(self, output_name: str, params: dict[str, Any]) -> tuple[Region, int, int]:
        region = self.get(params.get("shared_memory_region"))
        size = _non_negative(params.get("shared_memory_byte_size"), "shared_memory_byte_size")
        offset = _non_negative(params.get("shared_memory_offset", 0), "shared_memory_offset")
        region._start(offset, size, _Tensor("output", output_name))
        return region, size, offset

    def write_output(self, output_name: str, array: Array, params: dict[str, Any]) -> None:
        """Write an output into the region its parameters name. Its entry in the response
        then has no parameters at all: Triton's C++ client reads any it finds as binary
        data that follows the JSON."""
        region, size, offset = self._output_range(output_name, params)
        what = _Tensor("output", output_name)
        blob = to_wire(array)
        if len(blob) > size:
            raise BadRequest(
                f"{what} needs {len(blob)} bytes but its shared memory byte size is {size}. "
                "Hint: register and name a larger range"
            )
        region.write(offset, blob, what)


def _key(key: Any) -> str:
    if not isinstance(key, str) or not _KEY.match(key) or key.strip("/") in (".", ".."):
        raise BadRequest(
            f"'key' {shown(key)} is not a shared memory key; expected a POSIX shm name "
            "such as '/input_simple' (one leading slash, no other)"
        )
    if key.lstrip("/").startswith(_PRIVATE):
        raise BadRequest(
            f"{shown(key)} names one of the gateway's own segments (Python's psm_ names, "
            "which its worker arenas use, or the body decoder's infergate-decode- ones); "
            "register a region you created"
        )
    return key


def _check_size(fd: int, name: str, key: str, offset: int, byte_size: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise BadRequest(
            f"shared memory region {shown(name)}: {shown(key)} is not a shared memory object "
            "(not a regular file). Hint: create it with shm_open"
        )
    if offset + byte_size > info.st_size:
        raise BadRequest(
            f"shared memory region {shown(name)}: offset {offset} + byte_size {byte_size} "
            f"is past the end of {shown(key)}, which is {info.st_size} bytes"
        )


SYSTEM_SHM = SharedMemoryRegions()


def wants_shared_memory(params: Any) -> TypeGuard[dict[str, Any]]:
    return type(params) is dict and "shared_memory_region" in params
