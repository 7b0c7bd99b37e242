"""Reading TOML: a parsed table, walked section by section, each section checked against
its declaration (infergate/settings/declare.py), with errors that name the file, the key
and what was expected. Used by model.toml and the profile so both report problems the
same way, and both name unknown keys instead of silently ignoring a typo.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TypeVar

from infergate.errors import ConfigError
from infergate.settings.declare import Section, check

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

T = TypeVar("T")
S = TypeVar("S", bound=Section)


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None


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
        return check(section, given, str(self._source), self._prefix, " ".join(leave))

    def _get(self, key: str, kinds: tuple[type, ...], expected: str, default: T) -> Any:
        self._read.add(key)
        if key not in self._data:
            return default
        value = self._data[key]
        # bool is an int in Python; a TOML `true` where a number belongs is a mistake.
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self.where(key)}: expected {expected}, got {value!r}")
        if not isinstance(value, kinds):
            raise ConfigError(f"{self.where(key)}: expected {expected}, got {value!r}")
        return value

    def string(self, key: str, default: T, choices: tuple[str, ...] = ()) -> str | T:
        value = self._get(key, (str,), "a string", default)
        if choices and value is not default and value not in choices:
            raise ConfigError(
                f"{self.where(key)}: expected one of {', '.join(choices)}, got {value!r}"
            )
        return value  # type: ignore[no-any-return]

    def integer(
        self, key: str, default: T, minimum: int | None = None, maximum: int | None = None
    ) -> int | T:
        value = self._get(key, (int,), "an integer", default)
        if value is default:
            return value
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            if minimum is not None and maximum is not None:
                wanted = f"from {minimum} to {maximum}"
            else:
                wanted = f">= {minimum}" if minimum is not None else f"<= {maximum}"
            raise ConfigError(f"{self.where(key)}: expected an integer {wanted}, got {value}")
        return value  # type: ignore[no-any-return]

    def number(self, key: str, default: T, minimum: float | None = None) -> float | T:
        value = self._get(key, (int, float), "a number", default)
        if minimum is not None and value is not default and value < minimum:
            raise ConfigError(f"{self.where(key)}: expected a number >= {minimum}, got {value}")
        return value if value is default else float(value)

    def boolean(self, key: str, default: T) -> bool | T:
        return self._get(key, (bool,), "true or false", default)  # type: ignore[no-any-return]

    def array(self, key: str, default: T) -> list[Any] | T:
        return self._get(key, (list,), "an array", default)  # type: ignore[no-any-return]

    def table(self, key: str) -> Table:
        value = self._get(key, (dict,), "a table", {})
        return Table(value, self._source, f"{self._prefix}{key}.")

    def has(self, key: str) -> bool:
        return key in self._data

    def tables(self, key: str) -> list[Table]:
        """An array of tables ([[key]])."""
        items = self._get(key, (list,), "an array of tables", [])
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
