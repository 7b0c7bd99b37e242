"""The `infergate` command."""

from __future__ import annotations

import sys

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


def main() -> None:
    """Run the CLI; a usage mistake is one line on stderr and exit 2 (Click's own report
    is four: usage, a hint, a blank line, the error)."""
    # typer vendors its own Click (typer._click): its exceptions are these, not click's.
    from typer._click import exceptions as click

    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="infergate", standalone_mode=False)
    except click.NoArgsIsHelpError as exc:
        exc.show()
        sys.exit(2)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else "infergate"
        message = " ".join(exc.format_message().split())
        sys.stderr.write(f"error: {message}. Hint: {where} -h\n")
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
