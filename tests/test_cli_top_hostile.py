"""`infergate top` (the dashboard) against hostile servers and statistics of any shape:
it says what is wrong in one status line that fits, keeps polling, and never crashes; an
answer that drips is cut off at the poll's deadline, one past the cap is refused, and
whatever the server names (models, versions, reasons, tenants, devices, events) is shown
as written, never as markup nor as control characters. README's contract ("The
dashboard")."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from rich.text import Text
from textual.widgets import DataTable, Label, RichLog, Static

from infergate.tui.app import ConfirmScreen, Dashboard
from infergate.tui.source import FixedSource, HttpSource
from infergate.tui.tenants import TenantScreen
from tests.fake_servers import HTML_500, FakeServer, Route
from tests.polling import eventually
from tests.raw_servers import HOSTILE, HOSTILE_ESCAPED, assert_inert, raw_server

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


# --- answers over time and of any size: one deadline a request, a cap on each ---------

DEADLINE_S = 0.3  # the poll's deadline here (5 s by default)
SENDS_FOR_S = 30.0  # how long a dripping server goes on at most: a bound, not a delay


def drip(conn: socket.socket, stop: threading.Event, start: bytes, byte: bytes) -> None:
    """`start`, then a byte every 50 ms: each read gets one long before any per-read
    timeout, and the answer never ends (for SENDS_FOR_S)."""
    conn.sendall(start)
    ends = time.monotonic() + SENDS_FOR_S
    while not stop.wait(0.05) and time.monotonic() < ends:
        conn.sendall(byte)


def drip_body(conn: socket.socket, line: str, stop: threading.Event) -> None:
    drip(conn, stop, b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n[", b" ")


def drip_head(conn: socket.socket, line: str, stop: threading.Event) -> None:
    drip(conn, stop, b"HTTP/1.1 200 OK\r\nx-slow: ", b"a")


def endless_body(conn: socket.socket, line: str, stop: threading.Event) -> None:
    """A close-delimited body of 1 MB pieces, up to 64 MB: past the cap, yet bounded, so
    that a dashboard that reads it all (before the fix) cannot take the machine's memory."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
    for _ in range(64):
        if stop.is_set():
            return
        conn.sendall(b" " * (1 << 20))
    stop.wait(SENDS_FOR_S)


async def status_says(source: HttpSource, words: str) -> str:
    """The status line, once it says `words` (the dashboard polling every 50 ms)."""
    app = Dashboard(source, interval_s=0.05)
    async with app.run_test(size=(100, 24)):
        status = app.query_one("#status", Static)
        await eventually(says(status, words), what=words)
        assert app.connected is False
        return str(status.render())


@pytest.mark.parametrize(
    ("answer", "words"),
    [(drip_body, "no whole answer at /admin/stats within 0.3 s: a stalled server or proxy?"),
     (drip_head, "no answer at /admin/stats within 0.3 s; retrying every 0.05 s")],
    ids=["body", "head"],
)  # fmt: skip
async def test_an_answer_that_drips_is_cut_off_at_the_deadline(
    answer: Callable[[socket.socket, str, threading.Event], None], words: str
) -> None:
    """The dashboard's timeout was per read (5 s): a server that sent a byte now and then
    held each poll for ever, and the next poll cancelled it, so the status line never said
    a thing. A poll now has one deadline for the whole request, and is not cut short by
    the next tick."""
    with raw_server(answer) as url:
        await status_says(HttpSource(url, None, timeout_s=DEADLINE_S), words)


async def test_an_answer_past_the_cap_is_refused(fake: FakeServer) -> None:
    """The dashboard read whatever came: a body of any size, a gzip bomb unpacked whole.
    An answer is read up to the CLI's cap on a document (16 MB), refused past it."""
    refused = "more than 16 MB at /admin/stats: not an infergate server?"
    fake.routes["*"] = Route(mode="raw", raw=b"HTTP/1.1 200 OK\r\ncontent-type: application/json"
                             b"\r\ncontent-length: 838860800\r\n\r\n[")  # fmt: skip
    await status_says(HttpSource(fake.url, None), refused)
    bomb = gzip.compress(b" " * (17 << 20))  # 17 MB of spaces in 17 KB: counted unpacked
    fake.routes["*"] = Route(200, bomb, {"Content-Type": "application/json",
                                         "Content-Encoding": "gzip"})  # fmt: skip
    await status_says(HttpSource(fake.url, None), refused)
    with raw_server(endless_body) as url:  # no length: read as it comes, up to the cap
        source = HttpSource(url, None, max_answer_bytes=1 << 20)
        await status_says(source, "more than 1 MB at /admin/stats: not an infergate server?")


# --- what the server names: shown as written, escaped --------------------------------

MARKUP = "[/b][red]x"  # a closing tag with nothing open: read as markup, it failed the render


def hostile_stats() -> dict[str, Any]:
    """Statistics whose every string is the server's: control characters in them, and
    markup where the dashboard made cells of str (which a DataTable reads as markup)."""
    return {
        "devices": [{"name": f"gpu{HOSTILE}", "utilization": 5}],
        "workers": [{"model": f"w{HOSTILE}", "version": MARKUP, "instance": "\x1b[2J",
                     "pid": "1\r2"}],
        "models": [{"name": f"m{HOSTILE}", "state": "ready\x1b[5m", "breaker": "open\x07",
                    "versions": [MARKUP, "2\n3"], "instances_ready": MARKUP, "instances": 1,
                    "queue": {"\x1b[": MARKUP}, "errors": MARKUP, "reason": HOSTILE}],
        "tenants": [{"name": f"t{HOSTILE}", "class": MARKUP, "in_flight": "\x9b31m",
                     "admitted": MARKUP, "rejected": "\x00"}],
        "events": [{"id": 1, "time": 0, "kind": "load\x1b[31m", "model": MARKUP,
                    "version": "\r", "message": HOSTILE}],
    }  # fmt: skip


def cells(table: DataTable[Any], row: int) -> list[str]:
    return [str(c) for c in table.get_row_at(row)]


def log_text(log: RichLog) -> str:
    return "\n".join("".join(segment.text for segment in line) for line in log.lines)


async def test_what_the_server_names_is_shown_as_written_and_escaped(fake: FakeServer) -> None:
    """Versions, queue names, counts and a tenant's numbers went into the tables as str
    cells, which a DataTable reads as markup: a version named `[/b]` failed the render and
    took the dashboard down. Control characters in names, reasons, tenants, devices and
    events reached the terminal raw (an escape sequence clears it, a CR overwrites)."""
    fake.json("/admin/stats", hostile_stats())
    fake.json("/admin/tenants", {"tenants": [{"name": f"t{HOSTILE}", "rate_limited": 1}]})
    app = Dashboard(HttpSource(fake.url, None), interval_s=3600)
    async with app.run_test(size=(200, 40)) as pilot:
        await eventually(lambda: app.connected is True)
        await pilot.pause()
        models = app.query_one("#models", DataTable)
        row = cells(models, 0)
        for shown in row:
            assert_inert(shown)
        assert row[:6] == [f"m{HOSTILE_ESCAPED}", f"{MARKUP},2\\n3", "ready\\x1b[5m",
                           f"{MARKUP}/1", "open\\x07", f"\\x1b[:{MARKUP}"]  # fmt: skip
        assert row[9] == MARKUP
        assert row[10] == HOSTILE_ESCAPED[:60]
        tenants = cells(app.query_one("#tenants", DataTable), 0)
        for shown in tenants:
            assert_inert(shown)
        assert tenants[0] == f"t{HOSTILE_ESCAPED}"
        assert (tenants[1], tenants[3], tenants[5], tenants[6]) == (
            MARKUP, "\\x9b31m/-", MARKUP, "\\x00")  # fmt: skip
        devices = str(app.query_one("#devices", Static).render())
        assert_inert(devices.replace("\n", " "))  # (its own lines: a device, then its worker)
        assert devices.splitlines()[0].startswith(f"gpu{HOSTILE_ESCAPED}  util 5%")
        assert f"w{HOSTILE_ESCAPED} v{MARKUP}#\\x1b[2J pid 1\\r2" in devices
        events = log_text(app.query_one("#events", RichLog))
        assert_inert(events)
        assert f"load\\x1b[31m {MARKUP} v\\r: {HOSTILE_ESCAPED}" in events

        await pilot.press("t")  # the tenants view, from the tenants' own rows
        await eventually(lambda: isinstance(app.screen, TenantScreen))
        await pilot.pause()
        row = cells(app.screen.query_one("#tenant-view", DataTable), 0)
        assert row[0] == f"t{HOSTILE_ESCAPED}"
        for shown in row:
            assert_inert(shown)
        await pilot.press("escape")
        await eventually(lambda: not isinstance(app.screen, TenantScreen))

        await pilot.press("u")  # a dialog that names the model
        await eventually(lambda: isinstance(app.screen, ConfirmScreen))
        question = str(app.screen.query_one(Label).render())
        assert question.startswith(f"Unload m{HOSTILE_ESCAPED}? Its workers stop")
        await pilot.press("n")
        await eventually(lambda: not isinstance(app.screen, ConfirmScreen))
        assert app.connected is True  # still up, still polling
    assert app.return_code in (None, 0)


async def test_a_table_cell_is_never_read_as_markup() -> None:
    """Every cell the dashboard makes is a Text, shown as written: a str cell would be
    read as markup (the DataTable's own formatter), whatever its value."""
    app = Dashboard(FixedSource(hostile_stats()), interval_s=3600)
    async with app.run_test(size=(200, 40)) as pilot:
        await eventually(lambda: app.connected is True)
        await pilot.pause()
        for name in ("#models", "#tenants"):
            table = app.query_one(name, DataTable)
            for value in table.get_row_at(0):
                assert isinstance(value, Text), (name, value)
    assert app.return_code in (None, 0)
