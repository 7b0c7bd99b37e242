"""`infergate top`: the live dashboard."""

from __future__ import annotations

from infergate.cli.common import EXIT_USAGE, AdminTokenOption, UrlOption, fail, server_url


def top(url: UrlOption = None, token: AdminTokenOption = None) -> None:
    """Watch a server live: devices, models, breakers, queues, latencies, tenants, events."""
    from infergate.client_errors import UrlError
    from infergate.tui.app import Dashboard
    from infergate.tui.source import HttpSource

    try:
        source = HttpSource(server_url(url, token), token)
    except UrlError as exc:  # an https server whose certificates cannot be checked
        fail(str(exc), EXIT_USAGE)
    Dashboard(source).run()
