"""`infergate key`: mint API keys. The key is shown once; the profile keeps its hash."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated

import tomlkit
import typer
from tomlkit.items import Table

from infergate.cli.common import EXIT_USAGE, JsonOption, fail, make_app, print_json, say
from infergate.cli.helptext import example

app = make_app("Mint API keys for tenants and admins.")


def _add_hash(profile: Path, section: list[str], digest: str) -> None:
    """Append `digest` to the api_keys/admin_keys list at `section`, written atomically
    (a temp file and a rename, as the server does), checked as a profile first."""
    from infergate.errors import ConfigError
    from infergate.profile import load_profile

    document = tomlkit.parse(profile.read_text()) if profile.exists() else tomlkit.document()
    *tables, field = section
    node: Table | tomlkit.TOMLDocument = document
    for name in tables:
        if name not in node:
            node[name] = tomlkit.table(is_super_table=name == "tenants")
        child = node[name]
        if not isinstance(child, Table):
            fail(f"{profile}: [{'.'.join(tables)}] is not a table", EXIT_USAGE)
        node = child
    keys = node.get(field) or tomlkit.array()
    keys.append(digest)
    node[field] = keys
    tmp = profile.with_name(f".{profile.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(tomlkit.dumps(document))
        try:
            load_profile(tmp)
        except ConfigError as exc:
            fail(str(exc).replace(str(tmp), str(profile)), EXIT_USAGE)
        os.replace(tmp, profile)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


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
    if tenant is not None and not tenant.isidentifier():
        fail(f"tenant name {tenant!r}: letters, digits and _ only", EXIT_USAGE, json)
    key = new_key()
    digest = hash_key(key)
    section = ["server", "admin_keys"] if admin else ["tenants", tenant or "", "api_keys"]
    if write:
        _add_hash(profile, section, digest)
    where = "server.admin_keys" if admin else f"tenants.{tenant}.api_keys" if tenant else None
    if json:
        print_json(
            {
                "key": key,
                "sha256": digest,
                "for": where,
                "written_to": str(profile) if write else None,
            }
        )
        return
    say(f"key:  {key}\nhash: {digest}")
    if write:
        say(f"added to {where} in {profile}. The key is shown this once: store it now.", err=True)
    else:
        say(
            f"list the hash in {where or 'server.admin_keys or tenants.NAME.api_keys'}; "
            "the key is shown this once: store it now.",
            err=True,
        )
