"""What every command shares: the server options, output formats, errors and exit codes.

Text from the server, the user or the disk (names, reasons, paths, error messages) is never
parsed as Rich markup: it goes out as `Text` or with `markup=False`, so `dig[a-z]ts` and
`pip install 'infergate[torch]'` print as written. Help is plain Click help for the same
reason (typer's Rich help eats `[default: ...]`). Nor does any of it reach the terminal as
control characters: what prints (say, fail, emit_table, print_json) goes through
`escape_controls`, so a server's ESC sequences, CRs and BELs show as `\\x1b`, `\\r`, `\\x07`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import orjson
import typer

from infergate.cli.helptext import CONTEXT
from infergate.client_errors import escape_controls  # (re and orjson: nothing to wait for)

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


class Format(str, Enum):  # noqa: UP042  (typer's documented choice type; StrEnum untested here)
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


def client(
    url: str | None,
    token: str | None,
    as_json: bool = False,
    max_answer_mb: int | None = None,
    timeout_s: float | None = None,
) -> Client:
    """A client of the server at `url` (else INFERGATE_URL, the project's profile, the
    default); an address or a token that cannot be used is a usage mistake (exit 2).
    `max_answer_mb`: the largest inference answer read, `timeout_s` the deadline of each
    whole request (the client's defaults if None)."""
    from infergate.client import MAX_ANSWER_MB, Client, UrlError, default_url

    try:
        return Client(
            url or default_url(),
            token,
            timeout_s=timeout_s,
            max_answer_mb=max_answer_mb or MAX_ANSWER_MB,
        )
    except UrlError as exc:
        fail(str(exc), EXIT_USAGE, as_json)


def check_name(kind: str, name: str, as_json: bool = False) -> None:
    """A model's or tenant's name goes into a URL path, where `.` and `..` are read as
    path steps (`model unload .` was POST /v2/repository/models/unload: a model named
    "unload"): those, and an empty name, are usage mistakes here."""
    if name in ("", ".", ".."):
        fail(f"{kind} name {name!r}: not a name (empty, . or ..)", EXIT_USAGE, as_json)


def check_tenant_name(name: str, as_json: bool = False) -> None:
    """The server's rule for a new tenant's name (an identifier: letters, digits and _,
    not starting with a digit), for the commands that make one (`tenant add`, `key new`)."""
    check_name("tenant", name, as_json)
    if not name.isidentifier():
        fail(
            f"tenant name {name!r}: letters, digits and _ only, not starting with a digit",
            EXIT_USAGE,
            as_json,
        )


def check_tenant_in_path(name: str, as_json: bool = False) -> None:
    """A tenant named by `tenant set` or `remove`: any name a profile may hold ("team-a"
    in a hand-written one), sent as one escaped path segment, except one with a `/`, which
    the server reads as two path steps whatever the escaping (a 404 that named no tenant)."""
    check_name("tenant", name, as_json)
    if "/" in name:
        fail(
            f"tenant name {name!r}: a tenant's name has no '/' (the admin API could not "
            "address it). Hint: infergate tenant list",
            EXIT_USAGE,
            as_json,
        )


# The server's rule for a model's name (infergate/server/admin.py check_model_name, and the
# repository's scan, which serves no other): a folder or file name in the repository.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_model_name(name: str, as_json: bool = False) -> None:
    """A model named on the command line (`model load`, `infer`, `bench`, `breaker set`
    ...): a name no repository could hold (`a/b`, `../etc`, `_x`) is a usage mistake here,
    not a request the server answers with a 404 naming an endpoint."""
    check_name("model", name, as_json)
    if not _MODEL_NAME.fullmatch(name):
        fail(
            f"{name!r} is not a model name: a model is a folder or file in the repository, "
            "named with letters, digits, '_', '-' and '.', starting with a letter or digit. "
            "Hint: infergate model list",
            EXIT_USAGE,
            as_json,
        )


def check_models_folder(path: Path, what: str = "--models", as_json: bool = False) -> None:
    """A model repository given as a file (`--models model.onnx`) is a usage mistake that
    says so; a path that does not exist is left to the command, which says that."""
    if path.exists() and not path.is_dir():
        kind = "a file, not a folder" if path.is_file() else "not a folder"
        fail(
            f"{what} {path} is {kind}: {what} wants the model repository folder (one folder "
            "per model)",
            EXIT_USAGE,
            as_json,
        )


def server_url(url: str | None, token: str | None, as_json: bool = False) -> str:
    """The server's URL as a client would use it, the address and the token checked (a
    usage mistake, exit 2), without making a client."""
    from infergate.client import UrlError, check_token, default_url, normalize_url

    try:
        if token:
            check_token(token)
        return normalize_url(url) if url else default_url()
    except UrlError as exc:
        fail(str(exc), EXIT_USAGE, as_json)


# DEL and the C1 controls, which JSON lets a string hold as they are (orjson writes C0 as
# \u00XX already): as \u escapes, the same string, inert on a terminal.
_JSON_RAW_CONTROLS = re.compile("[\x7f-\x9f]")


def print_json(doc: Any) -> None:
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
    # Outside strings JSON is ASCII without controls: every match is inside a string.
    text = _JSON_RAW_CONTROLS.sub(lambda found: f"\\u{ord(found.group()):04x}", text)
    sys.stdout.write(text + "\n")


def _escaped_text(text: Text, keep_newlines: bool = False) -> Text:
    """A Rich `Text` with `escape_controls` applied piece by piece, its styles kept."""
    from rich.text import Span, Text

    if escape_controls(text.plain, keep_newlines) == text.plain:
        return text
    cuts = sorted({offset for span in text.spans for offset in (span.start, span.end)})
    out = Text(style=text.style, end=text.end)
    for piece in text.divide(cuts):  # each piece: one run of the same spans
        escaped = escape_controls(piece.plain, keep_newlines)
        out.append_text(Text(escaped, spans=[Span(0, len(escaped), s.style) for s in piece.spans]))
    return out


def _escaped(text: str | Text, keep_newlines: bool = False) -> str | Text:
    if isinstance(text, str):
        return escape_controls(text, keep_newlines)
    return _escaped_text(text, keep_newlines)


def say(text: str | Text, *, err: bool = False) -> None:
    """Print text as written (no markup), its control characters escaped but for line
    breaks: a server's text in it is escaped whole by the caller (`escape_controls`)."""
    console(err).print(_escaped(text, keep_newlines=True), markup=False, highlight=False)


def fail(message: str, code: int = EXIT_FAILURE, as_json: bool = False) -> NoReturn:
    """The error as one line on stderr (its control characters, line breaks too, escaped),
    or as {"error": ...} with --json; exit `code`."""
    if as_json:
        print_json({"error": message})
    else:
        from rich.text import Text

        line = Text.assemble(("error: ", "bold red"), escape_controls(message))
        console(stderr=True).print(line)
    raise typer.Exit(code)


def fail_client(exc: ClientError, as_json: bool = False) -> NoReturn:
    where = f" (HTTP {exc.status})" if exc.status else ""
    fail(f"{exc.message}{where}", EXIT_FAILURE, as_json)


STATE_STYLES = {
    "ready": "green",
    "loading": "yellow",
    "restarting": "yellow",
    "failed": "red",
    "refused": "red",
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
    for row in rows:  # newlines escaped too: a server's reason cannot fake rows
        table.add_row(
            *(_escaped_text(c) if isinstance(c, Text) else Text(escape_controls(c)) for c in row)
        )
    out = console()
    if out.is_terminal:
        out.print(table, soft_wrap=False)
    else:  # no terminal width to fit: as wide as the widest cell needs
        Console(width=100_000, highlight=False).print(table)


def _tsv(value: str) -> str:
    """A TSV field: backslashes doubled, then tabs, newlines and every other control
    character escaped (`\\t`, `\\n`, `\\r`, `\\x1b`): one field, one row, nothing raw."""
    return escape_controls(value.replace("\\", "\\\\"))


def request(url: str | None, token: str | None, as_json: bool, call: Callable[[Client], T]) -> T:
    """Run `call` on a client; a server's error becomes one clear line and exit 1."""
    from infergate.client import ClientError

    try:
        with client(url, token, as_json) as c:
            return call(c)
    except ClientError as exc:
        fail_client(exc, as_json)


# What reading a server's answer raises when it lacks a field or holds the wrong kind of
# value: a server that is not infergate (or not of this version), never a traceback.
SHAPE_ERRORS = (KeyError, TypeError, AttributeError, IndexError, ValueError, OverflowError)


@contextlib.contextmanager
def answer_of(url: str | None, as_json: bool) -> Iterator[None]:
    """Around the code that reads a server's answer (a table of it): a field that is
    missing or of another kind is one line and exit 1, naming the server."""
    try:
        yield
    except SHAPE_ERRORS as exc:
        from infergate.client import UrlError, default_url, normalize_url, one_line

        try:
            where = normalize_url(url) if url else default_url()
        except UrlError:
            where = "the server"
        detail = one_line(f"{type(exc).__name__}: {exc}", 200)
        fail(
            f"{where} answered with data infergate cannot read ({detail}). Hint: is it an "
            "infergate server (of this version)? Check --url or INFERGATE_URL",
            EXIT_FAILURE,
            as_json,
        )
