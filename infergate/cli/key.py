"""`infergate key`: mint API keys. The key is shown once; the profile keeps its hash."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import tomlkit
import typer
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import Table

from infergate.cli.common import (
    EXIT_USAGE,
    JsonOption,
    check_tenant_name,
    fail,
    make_app,
    print_json,
    say,
)
from infergate.cli.helptext import example

if TYPE_CHECKING:
    from infergate.profile import Profile

app = make_app("Mint API keys for tenants and admins.")


def _add_hash(profile: Path, section: list[str], digest: str, as_json: bool) -> Profile:
    """Append `digest` to the api_keys/admin_keys list at `section`, written atomically
    (a temp file and a rename, as the server does), checked as a profile first; the
    profile as written."""
    from infergate.errors import ConfigError
    from infergate.file_swap import swapped_in
    from infergate.profile import load_profile

    document = _read(profile, as_json) if profile.exists() else tomlkit.document()
    *tables, field = section
    node: Table | tomlkit.TOMLDocument = document
    for name in tables:
        if name not in node:
            node[name] = tomlkit.table(is_super_table=name == "tenants")
        child = node[name]
        if not isinstance(child, Table):
            fail(f"{profile}: [{'.'.join(tables)}] is not a table", EXIT_USAGE, as_json)
        node = child
    keys = node.get(field) or tomlkit.array()
    if not isinstance(keys, list):
        fail(f"{profile}: {'.'.join(section)} is not a list", EXIT_USAGE, as_json)
    keys.append(digest)
    node[field] = keys
    try:
        with swapped_in(profile) as (file, tmp):
            file.write(tomlkit.dumps(document).encode())
            file.flush()
            try:
                written = load_profile(tmp)
            except ConfigError as exc:
                fail(str(exc).replace(str(tmp), str(profile)), EXIT_USAGE, as_json)
    except OSError as exc:
        fail(f"cannot write {profile}: {exc.strerror or exc}", EXIT_USAGE, as_json)
    return written


def _read(profile: Path, as_json: bool) -> tomlkit.TOMLDocument:
    """The profile to edit, read as `serve` reads one (a regular file of at most
    MAX_PROFILE_BYTES: a FIFO would block for ever, /dev/zero never end) and checked to be
    TOML; one that is not is one line, exit 2."""
    from infergate.errors import ConfigError
    from infergate.settings.table import MAX_PROFILE_BYTES, parse_toml, read_toml

    try:
        data = read_toml(profile, MAX_PROFILE_BYTES)
        parse_toml(profile, data)  # its errors as `serve` says them, line and column
        return tomlkit.parse(data.decode())
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE, as_json)
    except TOMLKitError as exc:
        fail(f"{profile}: not valid TOML: {' '.join(str(exc).split())}", EXIT_USAGE, as_json)


def _has_tenant(profile: Path, name: str, as_json: bool) -> bool:
    """Does the profile define tenant `name`? (One with no [tenants] has `default`.)"""
    from infergate.engine.admission.tenants import DEFAULT_TENANT

    if not profile.exists():
        return False
    tenants = _read(profile, as_json).get("tenants")
    if not isinstance(tenants, Table):
        return name == DEFAULT_TENANT
    return name in tenants


def _tenant_json(profile: Profile, name: str, created: bool) -> dict[str, Any]:
    tenant = next(t for t in profile.tenants if t.name == name)
    return {
        "name": name,
        "created": created,
        "class": tenant.cls,
        "models": list(tenant.models),
        "keys": len(tenant.api_keys),
    }


def _written_lines(where: str, profile: Path, t: dict[str, Any] | None) -> list[str]:
    """What --write did: a tenant it created is said first and loudly (a typo makes one)."""
    lines = []
    added = f"added to {where} in {profile}"
    if t is not None and t["created"]:
        lines.append(
            f"created tenant {t['name']} (class: {t['class']}, models: "
            f"{', '.join(t['models'])}), as {profile} had no tenant of that name. Hint: a "
            f"typo? Remove it with: infergate tenant remove {t['name']}"
        )
    elif t is not None:
        keys = f"{t['keys']} keys" if t["keys"] > 1 else "1 key"
        added += f" (existing tenant {t['name']}, now with {keys})"
    return [*lines, f"{added}. The key is shown this once: store it now."]


@app.command(
    "new",
    epilog=example(
        "infergate key new --tenant acme --write",
        "infergate key new --admin --write --profile profiles/default.toml",
    ),
)
def new(
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin key (server.admin_keys)")
    ] = False,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="A key for this tenant (tenants.NAME.api_keys)")
    ] = None,
    write: Annotated[
        bool, typer.Option("--write", help="Add the key's hash to the profile")
    ] = False,
    profile: Annotated[Path, typer.Option(help="The profile --write edits")] = Path(
        "profiles/default.toml"
    ),
    json: JsonOption = False,
) -> None:
    """Print a new random API key once, with the sha256: hash that the profile lists
    (the key itself is stored nowhere). A running server picks a written hash up at once."""
    from infergate.engine.admission.tenants import hash_key, new_key

    if admin and tenant:
        fail("give --admin or --tenant NAME, not both", EXIT_USAGE, json)
    if write and not (admin or tenant):
        fail("--write needs --admin or --tenant NAME: whose key is it?", EXIT_USAGE, json)
    if tenant is not None:
        check_tenant_name(tenant, json)
    key = new_key()
    digest = hash_key(key)
    section = ["server", "admin_keys"] if admin else ["tenants", tenant or "", "api_keys"]
    where = "server.admin_keys" if admin else f"tenants.{tenant}.api_keys" if tenant else None
    written: dict[str, Any] | None = None  # the tenant as --write left it
    if write:
        existed = tenant is not None and _has_tenant(profile, tenant, json)
        after = _add_hash(profile, section, digest, json)
        if tenant is not None:
            written = _tenant_json(after, tenant, created=not existed)
    if json:
        print_json(
            {
                "key": key,
                "sha256": digest,
                "for": where,
                "written_to": str(profile) if write else None,
                "tenant": written,
            }
        )
        return
    say(f"key:  {key}\nhash: {digest}")
    if write:
        assert where is not None
        say("\n".join(_written_lines(where, profile, written)), err=True)
    else:
        say(
            f"list the hash in {where or 'server.admin_keys or tenants.NAME.api_keys'}; "
            "the key is shown this once: store it now.",
            err=True,
        )
