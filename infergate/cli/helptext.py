"""Help settings every command shares, apart from common.py so that the root app (cli/app.py)
builds its help without importing what the commands need (rich)."""

from __future__ import annotations

CONTEXT = {"help_option_names": ["-h", "--help"]}


def example(*lines: str) -> str:
    """An epilog that Click prints as written (\\b stops its rewrapping)."""
    return "Example:\n\n\b\n" + "\n".join(f"  $ {line}" for line in lines)
