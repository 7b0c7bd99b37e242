"""What every command shares: the server options, output formats, errors and exit codes.

Text from the server, the user or the disk (names, reasons, paths, error messages) is never
parsed as Rich markup: it goes out as `Text` or with `markup=False`, so `dig[a-z]ts` and
`pip install 'infergate[torch]'` print as written. Help is plain Click help for the same
reason (typer's Rich help eats `[default: ...]`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import orjson
import typer

from infergate.cli.helptext import CONTEXT

if TYPE_CHECKING:  # the client (httpx, numpy) loads when a command talks to a server; rich
    # when one prints
    from rich.console import Console
    from rich.text import Text

    from infergate.client import Client, ClientError

    Cell = str | Text


@functools.cache
def console(stderr: bool = False) -> Console:
    """Rich's console for stdout (lines as written, not rewrapped) or stderr (one
    greppable line), made on first use: rich is 20-40 ms to import, and `infergate
    serve`, which imports this module, prints with it only to fail."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Server URL, with or without http:// [default: $INFERGATE_URL, else the port "
        "of ./profiles/default.toml, else 127.0.0.1:8000]",
        show_default=False,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="INFERGATE_TOKEN",
        help="A tenant's API key, sent as a Bearer token [env: INFERGATE_TOKEN]",
        show_envvar=False,
    ),
]
AdminTokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="INFERGATE_ADMIN_TOKEN",
        help="An admin key, sent as a Bearer token [env: INFERGATE_ADMIN_TOKEN]",
        show_envvar=False,
    ),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print JSON (on a list, the same as --format json)")
]


class Format(str, Enum):
    table = "table"
    tsv = "tsv"
    json = "json"


FormatOption = Annotated[
    Format,
    typer.Option(
        "--format",
        help="table for people, tsv for cut/awk (a header line, then one row a line), "
        "json for scripts",
    ),
]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
T = TypeVar("T")


def make_app(help: str) -> typer.Typer:
    return typer.Typer(
        help=help, no_args_is_help=True, rich_markup_mode=None, context_settings=CONTEXT
    )


def client(url: str | None, token: str | None) -> Client:
    from infergate.client import Client, default_url

    return Client(url or default_url(), token)


def print_json(doc: Any) -> None:
    sys.stdout.write(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    )


def say(text: str | Text, *, err: bool = False) -> None:
    """Print text as written (no markup)."""
    console(err).print(text, markup=False, highlight=False)


def fail(message: str, code: int = EXIT_FAILURE, as_json: bool = False) -> NoReturn:
    if as_json:
        print_json({"error": message})
    else:
        from rich.text import Text

        console(stderr=True).print(Text.assemble(("error: ", "bold red"), message))
    raise typer.Exit(code)


def fail_client(exc: ClientError, as_json: bool = False) -> NoReturn:
    where = f" (HTTP {exc.status})" if exc.status else ""
    fail(f"{exc.message}{where}", EXIT_FAILURE, as_json)


STATE_STYLES = {
    "ready": "green",
    "loading": "yellow",
    "restarting": "yellow",
    "failed": "red",
    "unavailable": "red",
    "stopped": "dim",
}


def styled_state(state: str) -> Text:
    from rich.text import Text

    return Text(state, style=STATE_STYLES.get(state, ""))


def chosen_format(fmt: Format, json: bool) -> Format:
    return Format.json if json else fmt


def emit_table(
    headers: Sequence[str], rows: Sequence[Sequence[Cell]], fmt: Format, title: str | None = None
) -> None:
    """A table for people, or TSV. Cells are shown as written; on a terminal the table fits
    its width, elsewhere (a pipe, a file) it is whole: no cell is cut short."""
    if fmt is Format.tsv:
        lines = ["\t".join(headers)]
        for row in rows:
            lines.append("\t".join(_tsv(str(c)) for c in row))
        sys.stdout.write("\n".join(lines) + "\n")
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(*headers, title=title)
    for row in rows:
        table.add_row(*(c if isinstance(c, Text) else Text(c) for c in row))
    out = console()
    if out.is_terminal:
        out.print(table, soft_wrap=False)
    else:  # no terminal width to fit: as wide as the widest cell needs
        Console(width=100_000, highlight=False).print(table)


def _tsv(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def request(url: str | None, token: str | None, as_json: bool, call: Callable[[Client], T]) -> T:
    """Run `call` on a client; a server's error becomes one clear line and exit 1."""
    from infergate.client import ClientError

    try:
        with client(url, token) as c:
            return call(c)
    except ClientError as exc:
        fail_client(exc, as_json)
