"""The `infergate` command: the Typer app and its commands (run by infergate.cli.main).

A command's module is imported when that command runs (or when help lists it), not for
every command: `infergate serve` does not import the dashboard's, the load generator's or
the key minting's modules and what they import (rich, tomlkit, importlib.metadata), and
`infergate model list` does not import serve's. Every start pays for what it imports, and
the test suite starts about fifty gateways and many CLI processes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, NamedTuple

import typer
from typer._click import Command  # typer vendors Click: its classes, not click's
from typer.core import TyperGroup

from infergate import __version__
from infergate.cli.helptext import CONTEXT, example


class _Entry(NamedTuple):
    module: str  # under infergate.cli
    attr: str  # a command function, or a Typer of subcommands
    epilog: str | None = None


# In the order help lists them.
COMMANDS = {
    "serve": _Entry(
        "serve",
        "serve",
        example("infergate serve --models models --port 8000 --log-format json"),
    ),
    "infer": _Entry(
        "infer",
        "infer",
        example(
            "infergate infer digits examples/digit-7.npy",
            "infergate infer digits input=examples/digit-7.npy -o label --model-version 1 --json",
        ),
    ),
    "doctor": _Entry("doctor", "doctor", example("infergate doctor --models models")),
    "bench": _Entry(
        "bench",
        "bench",
        example(
            "infergate bench digits --concurrency-range 1:8:2",
            "infergate bench digits --request-rate-range 100,500 --request-distribution "
            "poisson -f out.csv",
        ),
    ),
    "top": _Entry("top", "top", example("infergate top --url localhost:8000 --token $ADMIN_KEY")),
    "model": _Entry("model", "app"),
    "tenant": _Entry("tenant", "app"),
    "breaker": _Entry("breaker", "app"),
    "key": _Entry("key", "app"),
}


def load_command(name: str) -> Command:
    """Import a command's module and build its Click command as Typer did when the root
    app registered them all (a holder app with the root's settings builds it)."""
    entry = COMMANDS[name]
    target = getattr(importlib.import_module(f"infergate.cli.{entry.module}"), entry.attr)
    holder = typer.Typer(pretty_exceptions_enable=False, rich_markup_mode=None)
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=name)
    else:
        holder.command(name=name, epilog=entry.epilog)(target)
    return typer.main.get_group(holder).commands[name]


class _Commands(MutableMapping[str, Command]):
    """The root group's commands: every name known, each built on first use. Click and
    Typer look commands up by name (running one, help, "Did you mean"), so this is where
    the import happens."""

    def __init__(self, load: Callable[[str], Command]) -> None:
        self._load = load
        self._built: dict[str, Command] = {}
        self._names = list(COMMANDS)

    def __getitem__(self, name: str) -> Command:
        if name not in self._built:
            if name not in self._names:
                raise KeyError(name)
            self._built[name] = self._load(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Command) -> None:
        if name not in self._names:
            self._names.append(name)
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)
        self._built.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)


class _Group(TyperGroup):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = _Commands(load_command)


app = typer.Typer(
    help="infergate: serve ONNX and TorchScript models over the KServe V2 protocol.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=CONTEXT,
    epilog=example("infergate serve", "infergate infer digits examples/digit-7.npy"),
    cls=_Group,
)


def _version(value: bool) -> None:
    if value:
        print(f"infergate {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        callback=_version,
        is_eager=True,
        help="Print the version and exit",
    ),
) -> None:
    pass
