"""Reading the fields of a server's statistics whatever they hold: the dashboard shows a
server that sends a field of another kind (a list where objects go, a string where a
number goes, null) as best it can, and never crashes on one; and showing them: as written
(never read as markup), control characters escaped."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.text import Text

from infergate.client_errors import escape_controls

PLOT_CEILING = 1e15  # larger values are no reading; summing them overflowed to NaN


def records(value: Any) -> list[dict[str, Any]]:
    """The objects in a list (others dropped); [] for anything else."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def text(value: Any, default: str = "") -> str:
    return default if value is None else str(value)


def shown(value: Any, default: str = "") -> str:
    """A server's value as text to show (`default` for none), its control characters
    escaped (`\\x1b`, `\\n`): a name cannot retitle or clear the terminal, nor fake a row."""
    return escape_controls(text(value, default))


def cell(value: Any, style: str = "") -> Text:
    """A table cell of a server's value, shown as written: a DataTable reads a str cell as
    markup (a version named `[/b]` failed the render, and the dashboard with it)."""
    return Text(shown(value), style=style)


def number(value: Any) -> float:
    """A finite number as a float; 0 for anything else (a string, null, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    value = float(value)
    return value if math.isfinite(value) else 0.0


def plot_value(value: Any) -> float:
    """A point of a plot: a number from 0 to PLOT_CEILING (a sparkline has no negatives)."""
    return min(max(number(value), 0.0), PLOT_CEILING)


def clock_time(value: Any) -> str:
    """HH:MM:SS of a Unix time, or --:--:-- when it is none (a string, out of range)."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(number(value)))
    except (OverflowError, OSError, ValueError):
        return "--:--:--"


def shown_number(value: Any, fmt: str = "{:.1f}") -> str:
    """A number as `fmt` writes it; "-" for anything that is not a number."""
    if not isinstance(value, (int, float)):
        return "-"
    try:
        return fmt.format(value)
    except ValueError:  # "{:d}" of a float: the number as it came
        return str(value)
