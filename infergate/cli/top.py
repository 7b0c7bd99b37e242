"""`infergate top`: the live dashboard."""

from __future__ import annotations

from infergate.cli.common import AdminTokenOption, UrlOption, server_url


def top(url: UrlOption = None, token: AdminTokenOption = None) -> None:
    """Watch a server live: devices, models, breakers, queues, latencies, tenants, events."""
    from infergate.tui.app import Dashboard
    from infergate.tui.source import HttpSource

    Dashboard(HttpSource(server_url(url, token), token)).run()
