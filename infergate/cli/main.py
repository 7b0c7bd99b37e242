"""The `infergate` command's entry point. It imports nothing itself: multiprocessing runs
the script that started the gateway (the `infergate` console script, which imports this
module) again in every worker before the worker's own code, so whatever this module
imported would be paid for at every worker start. The app lives in infergate.cli.app."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

    app: typer.Typer


def __getattr__(name: str) -> Any:
    """`from infergate.cli.main import app` still works, importing the app on first use."""
    if name == "app":
        from infergate.cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def usage_line(message: str, where: str) -> str:
    """Click's usage error as one line: its own full stop or question mark kept (not
    doubled), without the "Value error, " that pydantic puts before a validator's words,
    control characters escaped (it can quote a server's names: a model's inputs)."""
    from infergate.client_errors import escape_controls

    text = escape_controls(" ".join(message.replace("Value error, ", "").split()))
    stop = "" if text.endswith((".", "?", "!")) else "."
    return f"error: {text}{stop} Hint: {where} -h"


TRACEBACKS = "INFERGATE_TRACEBACKS"  # =1: an unexpected error shows its traceback


def unexpected_line(exc: BaseException) -> str:
    """An error no command expected (a bug, or a case not yet handled), in one line."""
    from infergate.client_errors import escape_controls

    said = escape_controls(" ".join(str(exc).split()))
    return (
        f"error: unexpected {type(exc).__name__}{': ' + said if said else ''}. Hint: this is a "
        f"bug in infergate; {TRACEBACKS}=1 shows where, for a report"
    )


def main() -> None:
    """Run the CLI; a usage mistake is one line on stderr and exit 2 (Click's own report
    is four: usage, a hint, a blank line, the error), and so is an error no command
    expected, with exit 1 (INFERGATE_TRACEBACKS=1 shows its traceback)."""
    import typer
    from typer._click import exceptions as click  # typer vendors Click: these, not click's

    from infergate.cli.app import app

    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="infergate", standalone_mode=False)
    except click.NoArgsIsHelpError as exc:
        exc.show()
        sys.exit(2)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else "infergate"
        sys.stderr.write(usage_line(exc.format_message(), where) + "\n")
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(1)
    except Exception as exc:
        if os.environ.get(TRACEBACKS) == "1":
            raise
        sys.stderr.write(unexpected_line(exc) + "\n")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
