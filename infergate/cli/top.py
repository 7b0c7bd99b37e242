"""`infergate top`: the live dashboard."""

from __future__ import annotations

from infergate.cli.common import TokenOption, UrlOption
from infergate.client import default_url


def top(url: UrlOption = None, token: TokenOption = None) -> None:
    """Watch a server live: devices, models, breakers, queues, latencies, tenants, events."""
    from infergate.tui.app import Dashboard
    from infergate.tui.source import HttpSource

    Dashboard(HttpSource(url or default_url(), token)).run()
