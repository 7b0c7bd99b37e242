"""What the admin API and the CLI may change in the profile, named and checked by the same
declarations that read the file: a tenant's settings ([tenants.NAME], its keys excepted:
they are made by `tenant add`, never set) and a model's breaker ([breaker.models.NAME])."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args, get_origin

from infergate.errors import ConfigError
from infergate.settings.declare import Section, check, keys
from infergate.settings.profile_sections import BreakerSection, TenantSection

# (its declaration, keys that are not set this way)
EDITABLE: dict[str, tuple[type[Section], frozenset[str]]] = {
    "tenant": (TenantSection, frozenset({"api_keys"})),
    "breaker": (BreakerSection, frozenset()),
}


def editable(what: str) -> list[str]:
    """The keys of a tenant ("tenant") or a breaker ("breaker") that an edit may set."""
    section, not_editable = EDITABLE[what]
    return sorted(set(keys(section)) - not_editable)


def is_list(what: str, key: str) -> bool:
    """Does `key` take a list (so the CLI reads `models=a,b` as two)?"""
    annotation = keys(EDITABLE[what][0])[key].annotation
    return get_origin(annotation) is list or any(
        get_origin(a) is list for a in get_args(annotation)
    )


def check_edit(what: str, values: Mapping[str, Any], prefix: str) -> None:
    """Refuse (ConfigError) an unknown key or a value its declaration refuses, naming the key
    with `prefix` ("tenants.acme."). A null is allowed: it removes the key, so the
    declared default applies again."""
    section = EDITABLE[what][0]
    unknown = sorted(set(values) - set(editable(what)))
    if unknown:
        known = ", ".join(editable(what))
        raise ConfigError(f"unknown {what} setting {unknown[0]!r}; known: {known}")
    check(section, {k: v for k, v in values.items() if v is not None}, "", prefix)
