"""`infergate top` (the dashboard) against hostile servers and statistics of any shape:
it says what is wrong in one status line that fits, keeps polling, and never crashes.
README's contract ("The dashboard")."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from textual.widgets import DataTable, Static

from infergate.tui.app import Dashboard
from infergate.tui.source import FixedSource, HttpSource
from infergate.tui.tenants import TenantScreen
from tests.fake_servers import HTML_500, FakeServer, Route
from tests.polling import eventually


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server


ODD_STATS: list[dict[str, Any]] = [
    {"models": ["a", "b"], "devices": "cpu", "workers": [1], "tenants": "t", "events": ["x"]},
    {"models": {"a": 1}, "throughput": [1, 2, 3]},
    {"models": [{"name": "a", "state": None, "breaker": 5, "versions": 7, "queue": [1],
                 "reason": 5}, {"name": "a"}, {"state": "ready"}]},
    {"devices": [{"name": "d", "memory_total_mb": "lots", "memory_used_mb": None}]},
    {"throughput": [{"rps": "fast", "p99_ms": None}, {"rps": float("inf"), "p99_ms": 1e308},
                    {"rps": 1e308, "p99_ms": float("nan")}]},
    {"events": [{"id": [1], "time": "yesterday", "kind": None},
                {"id": 2, "time": 1e20, "kind": "x"}, {"id": 3, "time": float("nan")}]},
    {"tenants": [{"name": "t"}, {"name": "t"}], "tenant_details": [1, {"name": "t",
     "rate_limited": 1.5}], "tenant_latency": {"t": [1, 2]}},
]  # fmt: skip


class CountingSource(FixedSource):
    def __init__(self, doc: dict[str, Any]) -> None:
        super().__init__(doc)
        self.fetches = 0

    async def fetch(self) -> dict[str, Any]:
        self.fetches += 1
        return self.doc


def polled(source: CountingSource, fetches: int) -> Callable[[], bool]:
    return lambda: source.fetches >= fetches


def says(status: Static, words: str) -> Callable[[], bool]:
    return lambda: words in str(status.render())


async def test_the_dashboard_survives_statistics_of_any_shape() -> None:
    source = CountingSource({})
    app = Dashboard(source, interval_s=0.05)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("t")  # the tenants view, open over the rest, reads each one too
        await eventually(lambda: isinstance(app.screen, TenantScreen))
        for doc in ODD_STATS:
            source.doc = doc
            await eventually(polled(source, source.fetches + 2), what="two polls of it")
            await pilot.pause()
            assert app.connected is True, (doc, str(app.query_one("#status", Static).render()))
        await pilot.press("escape")
        await eventually(lambda: not isinstance(app.screen, TenantScreen))
        assert [str(c) for c in app.query_one("#tenants", DataTable).get_row_at(0)][0] == "t"
    assert app.return_code in (None, 0)


async def test_the_dashboard_says_what_is_wrong_with_a_server_in_one_line(
    fake: FakeServer,
) -> None:
    cases: list[tuple[Route, str]] = [
        (Route(200, b"<html>hi</html>", {}), "not JSON at /admin/stats: not an infergate server?"),
        (Route(200, b"[1]"), "no statistics at /admin/stats: not an infergate server?"),
        (Route(200, b""), "no statistics at /admin/stats: not an infergate server?"),
        (Route(200, b"1e999"), "not JSON at /admin/stats"),
        (Route(500, HTML_500, {}), "500: an HTML page: 500 Internal Server Error; retrying"),
        (Route(400, b"[1, 2]"), "400: [1,2]; retrying"),
        (Route(400, json.dumps({"error": "a\nb"}).encode()), "400: a b; retrying"),
        (Route(302, b"", {"Location": "/x"}), "302: a redirect; give the server's own address"),
        (Route(503, b"y" * 500, {}), "503: yyy"),
    ]
    app = Dashboard(HttpSource(fake.url, None), interval_s=0.05)
    async with app.run_test(size=(80, 24)) as pilot:
        status = app.query_one("#status", Static)
        for route, words in cases:
            fake.routes["*"] = route
            await eventually(says(status, words), what=words)
            text = str(status.render())
            assert "\n" not in text
            assert len(text) <= status.content_region.width, text
            assert app.connected is False
        fake.json("/admin/stats", {"models": [{"name": "m", "state": "ready"}]})
        await eventually(lambda: app.connected is True)
        await pilot.pause()
        assert app.query_one("#models", DataTable).row_count == 1


class Unreadable(dict[str, Any]):
    """Statistics no field reader foresees: every read of a field fails."""

    def get(self, *_: Any) -> Any:
        raise RuntimeError("no reading\nthis")


async def test_the_dashboard_says_data_it_cannot_show_and_stays_up() -> None:
    app = Dashboard(FixedSource(Unreadable()), interval_s=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await eventually(lambda: app.connected is False)
        await pilot.pause()
        assert str(app.query_one("#status", Static).render()) == (
            "data the dashboard cannot show (RuntimeError: no reading this); retrying every…"
        )
    assert app.return_code in (None, 0)
