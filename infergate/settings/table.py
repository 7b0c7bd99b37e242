"""Reading TOML: a parsed table, walked section by section, each section checked against
its declaration (infergate/settings/declare.py), with errors that name the file, the key
and what was expected. Used by model.toml and the profile so both report problems the
same way, and both name unknown keys instead of silently ignoring a typo.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from infergate.errors import ConfigError
from infergate.settings.declare import Section, check

S = TypeVar("S", bound=Section)


# A model.toml is a few hundred bytes, a profile a few hundred per tenant: anything past
# these is refused unread (a 1.5 GB sparse file took 3 GB and stalled the gateway 6 s).
MAX_TOML_BYTES = 1 << 20
MAX_PROFILE_BYTES = 16 << 20


def load_toml(path: Path, max_bytes: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """The TOML document at `path`: a regular file (a FIFO would block the reading thread
    for good, a device never end) of at most `max_bytes`."""
    return parse_toml(path, read_toml(path, max_bytes))


def read_toml(path: Path, max_bytes: int = MAX_TOML_BYTES) -> bytes:
    """The bytes of the TOML file at `path`, as `load_toml` reads them."""
    return read_regular(path, max_bytes)


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` of them; ConfigError
    for anything else (a FIFO, a device, a folder, a larger file, one not readable)."""
    try:
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(
                    f"{path}: not a regular file; it is not read. Hint: put the file itself "
                    "there (a symlink to a regular file is fine)"
                )
            os.set_blocking(fd, True)
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise ConfigError(
            f"{path}: larger than {max_bytes >> 20} MiB; it is not read. Hint: is this the "
            "right file?"
        )
    return data


def parse_toml(path: Path, data: bytes) -> dict[str, Any]:
    """`data`, read from `path`, as a TOML document."""
    try:
        return tomllib.loads(data.decode())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 ({exc.reason})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from None


class Table:
    """A view of one TOML table that remembers which keys were read."""

    def __init__(self, data: dict[str, Any], source: Path, prefix: str = "") -> None:
        self._data = data
        self._source = source
        self._prefix = prefix
        self._read: set[str] = set()

    def where(self, key: str) -> str:
        return f"{self._source}: {self._prefix}{key}"

    def read(self, section: type[S], leave: tuple[str, ...] = ()) -> S:
        """This table's settings as declared by `section`; the keys in `leave` (sub-tables)
        are the caller's to read. Any other key is checked, an unknown one named."""
        given = {k: v for k, v in self._data.items() if k not in leave}
        self._read.update(given)
        return check(section, given, str(self._source), self._prefix, leave)

    def _get(self, key: str, kind: type, expected: str) -> Any:
        """A sub-table or an array of them: the structure, whose settings `read` checks."""
        self._read.add(key)
        value = self._data.get(key, kind())
        if not isinstance(value, kind):
            raise ConfigError(f"{self.where(key)}: expected {expected}, got {value!r}")
        return value

    def table(self, key: str) -> Table:
        value = self._get(key, dict, "a table")
        return Table(value, self._source, f"{self._prefix}{key}.")

    def has(self, key: str) -> bool:
        return key in self._data

    def tables(self, key: str) -> list[Table]:
        """An array of tables ([[key]])."""
        items = self._get(key, list, "an array of tables")
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ConfigError(f"{self.where(key)}[{i}]: expected a table, got {item!r}")
            out.append(Table(item, self._source, f"{self._prefix}{key}[{i}]."))
        return out

    def names(self) -> list[str]:
        self._read.update(self._data)
        return list(self._data)

    def reject_unknown(self) -> None:
        unknown = sorted(set(self._data) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read)) or "none"
            raise ConfigError(
                f"{self._source}: unknown key {self._prefix}{unknown[0]}"
                f" (known keys here: {known}); check the spelling"
            )
