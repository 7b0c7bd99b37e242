"""What every command shares: the server options, JSON output, errors and exit codes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any, NoReturn, TypeVar

import orjson
import typer
from rich.console import Console

from infergate.client import Client, ClientError, default_url

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # errors stay one greppable line

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url", envvar="INFERGATE_URL", help="Server URL [default: http://127.0.0.1:8000]"
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="INFERGATE_TOKEN", help="API key sent as a Bearer token"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
T = TypeVar("T")


def client(url: str | None, token: str | None) -> Client:
    return Client(url or default_url(), token)


def print_json(doc: Any) -> None:
    sys.stdout.write(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    )


def fail(message: str, code: int = EXIT_FAILURE, as_json: bool = False) -> NoReturn:
    if as_json:
        print_json({"error": message})
    else:
        err_console.print(f"[bold red]error:[/] {message}", highlight=False)
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


def styled_state(state: str) -> str:
    return f"[{STATE_STYLES.get(state, 'white')}]{state}[/]"


def request(url: str | None, token: str | None, as_json: bool, call: Callable[[Client], T]) -> T:
    """Run `call` on a client; a server's error becomes one clear line and exit 1."""
    try:
        with client(url, token) as c:
            return call(c)
    except ClientError as exc:
        fail_client(exc, as_json)
