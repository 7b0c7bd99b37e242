"""Reading a server's /metrics the way Prometheus would. A series that is not there fails
the test that reads it: a missing gauge is not a zero."""

from __future__ import annotations

import re

import httpx

from tests.server import ServerProcess


def metric(server: ServerProcess, name: str, absent: float | None = None, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`. When none matches, fail,
    unless the caller says what a series not yet created counts as (`absent`: a counter
    read before the traffic that creates it)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found, total = False, 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            found, total = True, total + float(m.group(2))
    if not found:
        if absent is not None:
            return absent
        raise AssertionError(f"/metrics has no series {name}{labels or ''}")
    return total
