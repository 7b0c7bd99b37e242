"""How a setting is declared, checked and described.

A section is a frozen pydantic model: each field is one setting, declared with `setting()`
(its default, bounds and help). `check()` validates a TOML table (or an admin edit, or CLI
values) against it and turns pydantic's first error into our wording, built from the
declaration itself: `FILE: section.key: expected a number >= 0.1, got 0`, or an unknown
key named with the keys that are known there. `describe()` gives the same words to the
README's reference, so the file, the errors and the docs cannot drift apart.
"""

from __future__ import annotations

import reprlib
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo

from infergate.errors import ConfigError

S = TypeVar("S", bound="Section")
MAX_TEXT = 4096  # characters in any string setting (a path, a URL, a name)
MAX_ITEMS = 1024  # items in any list setting (keys, globs, endpoints)
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 80  # errors quote what came, briefly
_SHOWN.maxlist = 8


class Section(BaseModel):
    """A table of settings. Strict: TOML's types are what the file says, so "8000" is not
    a port and `true` is not a number; unknown keys are refused, never ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, str_max_length=MAX_TEXT)

    @field_validator("*")
    @classmethod
    def _bounded_list(cls, value: Any) -> Any:
        """A file or an admin edit is hostile until bounded: no list of a million globs."""
        if isinstance(value, list) and len(value) > MAX_ITEMS:
            raise ValueError(f"a list of at most {MAX_ITEMS} items")
        return value


def setting(
    default: Any,
    help: str,  # noqa: A002  # the declaration's words, shown in errors' hints and the README
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    expected: str | None = None,
    hint: str | None = None,
    unit: str = "",
) -> Any:
    """One setting. `expected` replaces the generated "an integer >= 1" where the type and
    bounds do not say it all (a URL, a key hash); `hint` ends each error about it."""
    extra: dict[str, Any] = {"unit": unit}
    if expected is not None:
        extra["expected"] = expected
    if hint is not None:
        extra["hint"] = hint
    if isinstance(default, list):
        if (ge, gt, le) != (None, None, None):  # they would bound the list, not its items
            raise TypeError("setting(): bounds on a list setting; use Field with item bounds")
        value = list(default)
        return Field(
            default_factory=lambda: list(value),
            description=help,
            json_schema_extra=extra,
        )
    return Field(default, description=help, ge=ge, gt=gt, le=le, json_schema_extra=extra)


def _extra(info: FieldInfo) -> Mapping[str, Any]:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _fmt(bound: object) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def _kind(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _kind(inner[0])
    if origin is Annotated:
        return _kind(get_args(annotation)[0])
    if origin is list:
        (item,) = get_args(annotation)
        item = get_args(item)[0] if get_origin(item) is Annotated else item
        plural = {int: "integers", float: "numbers", str: "strings"}.get(item, "values")
        return f"a list of {plural}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        annotation, "a value"
    )


def bounds(info: FieldInfo) -> str:
    """ ">= 0.1", "from 0 to 19", "" for none."""
    least: object = None
    most: object = None
    strict = False
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            least = m.ge
        elif isinstance(m, annotated_types.Gt):
            least, strict = m.gt, True
        elif isinstance(m, annotated_types.Le):
            most = m.le
    if least is not None and most is not None:
        return f"from {_fmt(least)} to {_fmt(most)}"
    if least is not None:
        return f"{'>' if strict else '>='} {_fmt(least)}"
    if most is not None:
        return f"<= {_fmt(most)}"
    return ""


def describe(info: FieldInfo) -> str:
    """What a value must be, in words: "an integer from 0 to 19", "a number >= 0.1 (s)"."""
    custom = _extra(info).get("expected")
    if custom is not None:
        return str(custom)
    kind = _kind(info.annotation)
    limit = bounds(info)
    unit = _extra(info).get("unit")
    wanted = f"{kind} {limit}" if limit else kind
    return f"{wanted} ({unit})" if unit else wanted


def check(
    section: type[S],
    data: Mapping[str, Any],
    where: str,
    prefix: str = "",
    also: tuple[str, ...] = (),
) -> S:
    """`data` as `section`, or a ConfigError naming `where` (the file), the key with its
    `prefix` (e.g. "breaker."), what the declaration expects and what came. `also` names
    keys the caller reads itself (sub-tables), listed among the known keys."""
    try:
        return section.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_message(section, exc, data, where, prefix, also)) from None


def _message(
    section: type[Section],
    exc: ValidationError,
    data: Mapping[str, Any],
    where: str,
    prefix: str,
    also: tuple[str, ...],
) -> str:
    error = exc.errors()[0]
    loc = error["loc"]
    key = str(loc[0]) if loc else ""
    head = f"{where}: " if where else ""
    fields = keys(section)
    if error["type"] == "extra_forbidden" or key not in fields:
        known = ", ".join(sorted([*fields, *also])) or "none"
        return f"{head}unknown key {prefix}{key} (known keys here: {known}); check the spelling"
    info = fields[key]
    value = data.get(key)
    if len(loc) > 1 and isinstance(value, list) and isinstance(loc[1], int):
        value = value[loc[1]]  # the one item of a list that is wrong
    custom = "expected" in _extra(info)
    if error["type"] == "string_too_long":
        wanted, got = f"at most {MAX_TEXT} characters", f"{len(str(value))}"
    elif error["type"] == "value_error":
        wanted, got = str(error["ctx"]["error"]), f"{len(value or ())} items"
    elif error["type"] in ("greater_than_equal", "greater_than", "less_than_equal") or custom:
        wanted = describe(info)
        got = _SHOWN.repr(value)
    elif get_origin(info.annotation) is Literal:
        wanted, got = describe(info), _SHOWN.repr(value)
    elif error["type"] == "missing":
        wanted, got = describe(info), "nothing"
    else:  # a wrong type: what kind of value belongs here
        wanted, got = _kind(info.annotation), _SHOWN.repr(value)
    hint = _extra(info).get("hint")
    tail = f". Hint: {hint}" if hint else ""
    return f"{head}{prefix}{key}: expected {wanted}, got {got}{tail}"


def keys(section: type[Section]) -> dict[str, FieldInfo]:
    """The section's settings by the key a file uses ("class", not the field's `cls`)."""
    return {info.alias or name: info for name, info in section.model_fields.items()}


def given(section: Section) -> dict[str, Any]:
    """The settings a table set, by field name: an override table's keys, to lay over a
    base record with dataclasses.replace."""
    return {name: getattr(section, name) for name in section.model_fields_set}
