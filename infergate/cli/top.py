"""`infergate top`: the live dashboard."""

from __future__ import annotations

from infergate.cli.common import AdminTokenOption, UrlOption


def top(url: UrlOption = None, token: AdminTokenOption = None) -> None:
    """Watch a server live: devices, models, breakers, queues, latencies, tenants, events."""
    from infergate.client import default_url, normalize_url
    from infergate.tui.app import Dashboard
    from infergate.tui.source import HttpSource

    Dashboard(HttpSource(normalize_url(url) if url else default_url(), token)).run()
