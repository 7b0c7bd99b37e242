"""The `infergate` command."""

from __future__ import annotations

import typer

from infergate import __version__
from infergate.cli import breaker, model, tenant
from infergate.cli.bench import bench
from infergate.cli.doctor import doctor
from infergate.cli.infer import infer
from infergate.cli.serve import serve
from infergate.cli.top import top

app = typer.Typer(
    help="infergate: serve ONNX and TorchScript models over the KServe V2 protocol.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command()(serve)
app.command()(infer)
app.command()(doctor)
app.command()(bench)
app.command()(top)
app.add_typer(model.app, name="model")
app.add_typer(tenant.app, name="tenant")
app.add_typer(breaker.app, name="breaker")


def _version(value: bool) -> None:
    if value:
        print(f"infergate {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit"
    ),
) -> None:
    pass


def main() -> None:
    app()
