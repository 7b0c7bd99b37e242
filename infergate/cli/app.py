"""The `infergate` command: the Typer app and its commands (run by infergate.cli.main)."""

from __future__ import annotations

import typer

from infergate import __version__
from infergate.cli import breaker, key, model, tenant
from infergate.cli.bench import bench
from infergate.cli.common import CONTEXT, example
from infergate.cli.doctor import doctor
from infergate.cli.infer import infer
from infergate.cli.serve import serve
from infergate.cli.top import top

app = typer.Typer(
    help="infergate: serve ONNX and TorchScript models over the KServe V2 protocol.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=CONTEXT,
    epilog=example("infergate serve", "infergate infer digits examples/digit-7.npy"),
)
app.command(epilog=example("infergate serve --models models --port 8000 --log-format json"))(serve)
app.command(
    epilog=example(
        "infergate infer digits examples/digit-7.npy",
        "infergate infer mlp 'x=[[1, 2, 3, 4]]' --model-version 1 --json",
    )
)(infer)
app.command(epilog=example("infergate doctor --models models"))(doctor)
app.command(
    epilog=example(
        "infergate bench digits --concurrency-range 1:8:2",
        "infergate bench digits --request-rate-range 100,500 --request-distribution poisson "
        "-f out.csv",
    )
)(bench)
app.command(epilog=example("infergate top --url localhost:8000 --token $ADMIN_KEY"))(top)
app.add_typer(model.app, name="model")
app.add_typer(tenant.app, name="tenant")
app.add_typer(breaker.app, name="breaker")
app.add_typer(key.app, name="key")


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
