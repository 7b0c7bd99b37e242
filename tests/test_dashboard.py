"""`infergate top`: Textual Pilot tests against a live server, a layout snapshot on fixed
data, and the real command in a real terminal (tmux)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from textual.widgets import DataTable, Static

from infergate.tui.app import ConfirmScreen, Dashboard
from infergate.tui.source import FixedSource, HttpSource
from tests.conftest import BAD_REQUEST
from tests.server import ServerProcess


def cell(app: Dashboard, model: str, column: int) -> str:
    table = app.query_one("#models", DataTable)
    return str(table.get_row(model)[column])


async def until(pilot: Any, check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        await pilot.pause(0.1)


async def test_lists_models_and_shows_a_breaker_opening(breaker_server: ServerProcess) -> None:
    app = Dashboard(HttpSource(breaker_server.url, None), interval_s=0.2)
    async with app.run_test(size=(150, 45)) as pilot:
        table = app.query_one("#models", DataTable)
        await until(pilot, lambda: table.row_count == 2)
        assert cell(app, "mlp", 2) == "ready"
        assert cell(app, "flaky", 4) == "closed"
        async with httpx.AsyncClient() as http:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                r = await http.post(f"{breaker_server.url}/v2/models/flaky/infer", json=BAD_REQUEST)
                if r.status_code == 503:
                    break
                await pilot.pause(0.05)
        await until(pilot, lambda: cell(app, "flaky", 4) == "open")
        assert cell(app, "mlp", 4) == "closed"
        await until(pilot, lambda: int(cell(app, "flaky", 9)) > 0)  # errors counted
        table.move_cursor(row=table.get_row_index("flaky"))
        await pilot.press("r")  # reset the selected model's breaker
        await until(pilot, lambda: cell(app, "flaky", 4) == "closed")


async def test_survives_the_server_going_away_and_coming_back(
    breaker_server: ServerProcess,
) -> None:
    app = Dashboard(HttpSource(breaker_server.url, None), interval_s=0.2)
    async with app.run_test(size=(150, 45)) as pilot:
        await until(pilot, lambda: app.connected is True)
        breaker_server.stop()
        await until(pilot, lambda: app.connected is False)
        status = str(app.query_one("#status", Static).render())
        assert "server unreachable" in status
        assert app.query_one("#models", DataTable).row_count == 2  # the last data stays
        breaker_server.start()
        await until(pilot, lambda: app.connected is True, timeout_s=60)
        assert "connected to" in str(app.query_one("#status", Static).render())


FIXED: dict[str, Any] = {
    "devices": [
        {
            "name": "cpu (2 cores)",
            "kind": "cpu",
            "utilization": 37.0,
            "memory_total_mb": 24576,
            "memory_used_mb": 6144,
        }
    ],
    "workers": [{"model": "digits", "version": 2, "instance": 0, "pid": 4242, "memory_mb": 81.5}],
    "models": [
        {
            "name": "digits",
            "state": "ready",
            "versions": [1, 2],
            "instances_ready": 1,
            "instances": 1,
            "breaker": "closed",
            "queue": {"realtime": 0, "batch": 3},
            "rps": 812.5,
            "p50_ms": 0.91,
            "p99_ms": 1.73,
            "errors": 0,
            "reason": None,
        },
        {
            "name": "flaky",
            "state": "ready",
            "versions": [1],
            "instances_ready": 1,
            "instances": 1,
            "breaker": "open",
            "queue": {},
            "rps": 3.0,
            "p50_ms": 1.2,
            "p99_ms": 2.5,
            "errors": 17,
            "reason": "version 2: load failed: corrupt",
        },
        {"name": "encoder", "state": "unavailable"},  # a server that omits fields
    ],
    "tenants": [
        {
            "name": "default",
            "class": "burst",
            "rps_limit": 200,
            "rps": 41.5,
            "reserved_mb": 1024,
            "memory_mb": 4096,
            "in_flight": 2,
            "max_concurrency": 64,
            "admitted": 9000,
            "rejected": 12,
        }
    ],
    "throughput": [{"t": i, "rps": (i * 37) % 900, "p99_ms": 1 + (i % 7) / 3} for i in range(120)],
    "events": [
        {
            "id": 1,
            "kind": "breaker_open",
            "model": "flaky",
            "version": 1,
            "message": "failure rate 100% over 6 requests (limit 50%)",
            "time": 0,
        }
    ],
}


def test_layout_snapshot(snap_compare: Any) -> None:
    app = Dashboard(FixedSource(FIXED), interval_s=3600, clock=lambda: "12:00:00")

    async def loaded(pilot: Any) -> None:
        await until(pilot, lambda: app.connected is True)
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(140, 42), run_before=loaded)


async def test_unload_asks_first_and_help_opens() -> None:
    source = FixedSource(FIXED)
    app = Dashboard(source, interval_s=3600)
    async with app.run_test(size=(140, 42)) as pilot:
        await pilot.pause()
        await pilot.press("u")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.click("#no")
        await pilot.pause()
        assert source.actions == []
        await pilot.press("u")
        await pilot.pause()
        await pilot.click("#yes")
        await until(pilot, lambda: source.actions == [("unload", "digits")])
        await pilot.press("question_mark")
        await pilot.pause()
        assert "reset the selected model" in str(app.screen.query_one("Label").render())


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_in_a_real_terminal_shows_models_quickly(
    breaker_server: ServerProcess, tmp_path: Path
) -> None:
    import sys

    infergate = Path(sys.executable).parent / "infergate"
    session = f"top{breaker_server.port}"
    started = time.monotonic()
    subprocess.run(
        [
            "tmux",
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "150",
            "-y",
            "45",
            f"{infergate} top --url {breaker_server.url}",
        ],
        check=True,
    )
    try:
        shown = None
        while time.monotonic() - started < 10:
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if "flaky" in screen and "mlp" in screen:
                shown = time.monotonic() - started
                break
            time.sleep(0.05)
        assert shown is not None, screen
        assert shown < 2.0, f"the models took {shown:.2f} s to show"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
