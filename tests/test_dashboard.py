"""`infergate top`: Textual Pilot tests against a live server, a layout snapshot on fixed
data, and the real command in a real terminal (tmux)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from textual.widgets import DataTable, Sparkline, Static

from infergate.engine.admission.tenants import hash_key
from infergate.tui.app import ConfirmScreen, Dashboard
from infergate.tui.source import FixedSource, HttpSource
from infergate.tui.tenants import TenantScreen
from tests.conftest import BAD_REQUEST, breaker_server_in, write_profile
from tests.onnx_models import make_mlp
from tests.server import ServerProcess, free_port


def cell(app: Dashboard, model: str, column: int) -> str:
    table = app.query_one("#models", DataTable)
    return str(table.get_row(model)[column])


@pytest.fixture(scope="module")
def breaker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One breaker server (conftest's breaker_server_in) for the file: each start costs a
    second of CPU. A test that stops it starts it again; the others only watch it, and
    the one that opens flaky's breaker closes it again."""
    proc = breaker_server_in(tmp_path_factory.mktemp("breaker"))
    yield proc.start()
    proc.stop()


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
        await pilot.press("r")  # reset the selected model's breaker, after a yes
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
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
        assert status.startswith(f"cannot reach {breaker_server.url} (")
        assert app.query_one("#models", DataTable).row_count == 2  # the last data stays
        events = app.query_one("#events")
        before = text_of(events).count("model_ready")
        breaker_server.start()
        await until(pilot, lambda: app.connected is True, timeout_s=60)
        assert "connected to" in str(app.query_one("#status", Static).render())
        # The new server numbers its events from 1 again; they still show.
        await until(pilot, lambda: text_of(events).count("model_ready") >= before + 2)


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


async def test_tenant_rows_that_come_before_the_screen_mounts_are_shown() -> None:
    """A poll may land between pushing the tenant screen and its mount (seen under load:
    rows added before the table had columns killed the dashboard's poll worker)."""
    app = Dashboard(FixedSource(FIXED), interval_s=3600)
    async with app.run_test(size=(140, 42)) as pilot:
        await pilot.pause()
        screen = TenantScreen([])
        app.push_screen(screen)
        screen.update_rows([("late", "1.0 / 2", "0 / 1", "-", "0", "0", "0", "1")])
        await pilot.pause()
        table = screen.query_one("#tenant-view", DataTable)
        assert [str(c) for c in table.get_row("late")][0] == "late"


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


async def test_arrows_move_in_models_from_the_start_and_confirmations_default_to_no() -> None:
    source = FixedSource(FIXED)
    app = Dashboard(source, interval_s=3600)
    async with app.run_test(size=(140, 42)) as pilot:
        await until(pilot, lambda: app.selected_model() == "digits")
        assert app.focused is app.query_one("#models", DataTable)
        await pilot.press("down")
        assert app.selected_model() == "flaky"
        for key in ("u", "l", "r"):
            await pilot.press(key)
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("enter")  # No has the focus
            await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
        assert source.actions == []
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await until(pilot, lambda: source.actions == [("reset", "flaky")])


async def test_keys_of_the_hidden_models_table_do_nothing_in_the_tenants_view() -> None:
    doc = {**FIXED, "tenants": [*FIXED["tenants"], {"name": "open", "in_flight": 0}]}
    source = FixedSource(doc)
    app = Dashboard(source, interval_s=3600)
    async with app.run_test(size=(140, 42)) as pilot:
        await until(pilot, lambda: app.selected_model() == "digits")
        await pilot.press("t")
        await until(pilot, lambda: isinstance(app.screen, TenantScreen))
        table = app.screen.query_one("#tenant-view", DataTable)
        # No max_concurrency: "-", as the main panel says, not "None".
        assert [str(c) for c in table.get_row("open")][2] == "0 / -"
        assert [str(c) for c in table.get_row("default")][2] == "2 / 64"
        await pilot.press("down", "u", "l", "r")
        for action in ("unload", "load", "reset_breaker"):  # however an action comes
            await app.run_action(action)
        await pilot.pause()
        assert isinstance(app.screen, TenantScreen)  # no "Unload ...?" drawn over it
        assert app.selected_model() == "digits"
        assert source.actions == []
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, TenantScreen))
        await pilot.press("u")  # back on the models table, its keys work again
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))


def text_of(widget: Any) -> str:
    return "\n".join("".join(seg.text for seg in strip) for strip in widget.lines)


async def test_small_terminal_keeps_the_status_line_and_the_help_whole() -> None:
    app = Dashboard(FixedSource(FIXED), interval_s=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.connected is True)
        status = app.query_one("#status", Static)
        assert (status.region.y, status.region.height) == (22, 1)
        assert app.screen.virtual_size.height == 24  # nothing pushed below the screen
        await pilot.press("question_mark")
        await pilot.pause()
        label = app.screen.query_one("Label")
        assert app.screen.region.contains_region(label.region)
        assert label.region.height == len(str(label.render()).splitlines())


async def test_plots_empty_when_idle_with_units_and_scale_otherwise() -> None:
    idle = {**FIXED, "throughput": [{"t": i, "rps": 0, "p99_ms": 0.0} for i in range(120)]}
    source = FixedSource(idle)
    app = Dashboard(source, interval_s=0.1)
    async with app.run_test(size=(140, 42)) as pilot:
        await until(pilot, lambda: app.connected is True)
        assert list(app.query_one("#rps", Sparkline).data or []) == []
        assert "no requests in the last 120 s" in str(app.query_one("#rps-label").render())
        source.doc = FIXED
        label = app.query_one("#rps-label")
        await until(pilot, lambda: "top of scale" in str(label.render()))
        assert str(label.render()).startswith("requests/s, last 2 min: now ")
        assert str(app.query_one("#p99-label").render()).startswith("p99 ms, last 2 min")


async def test_names_and_events_are_shown_as_written() -> None:
    doc = {
        **FIXED,
        "models": [{"name": "[b]x[/b]", "state": "failed", "reason": "pip install 'a[torch]'"}],
        "tenants": [{"name": "dig[a-z]ts", "class": "burst"}],
        "events": [{"id": 1, "kind": "k", "model": "[/x]", "message": "[red]m", "time": 0}],
    }
    app = Dashboard(FixedSource(doc), interval_s=3600)
    async with app.run_test(size=(140, 42)) as pilot:
        await until(pilot, lambda: app.connected is True)
        models = app.query_one("#models", DataTable)
        assert str(models.get_row_at(0)[0]) == "[b]x[/b]"
        assert str(models.get_row_at(0)[10]) == "pip install 'a[torch]'"
        assert str(app.query_one("#tenants", DataTable).get_row_at(0)[0]) == "dig[a-z]ts"
        assert "k [/x]: [red]m" in text_of(app.query_one("#events"))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.serial  # "within 2 s" of a wall clock: run alone
def test_top_in_a_real_terminal_shows_models_quickly(
    breaker_server: ServerProcess, tmp_path: Path
) -> None:
    import sys

    infergate = Path(sys.executable).parent / "infergate"
    session = f"top{breaker_server.port}"
    # A tmux server of this test's own: a shared one (another test run's) would start
    # `top` in its environment, and live on after this test.
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    started = time.monotonic()
    subprocess.run(
        [
            *tmux,
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
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if "flaky" in screen and "mlp" in screen:
                shown = time.monotonic() - started
                break
            time.sleep(0.05)
        assert shown is not None, screen
        assert shown < 2.0, f"the models took {shown:.2f} s to show"
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)  # and `top` with it


ADMIN, TENANT = "top-admin-key", "top-tenant-key"


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """An admin key, and a tenant held to 2 requests/s."""
    folder = tmp_path_factory.mktemp("top")
    make_mlp(folder / "models" / "mlp" / "1" / "model.onnx")
    profile = f"""
[server]
admin_keys = ["{hash_key(ADMIN)}"]
[tenants.slowpoke]
rps = 2
burst = 2
api_keys = ["{hash_key(TENANT)}"]
"""
    proc = ServerProcess(folder / "models", write_profile(folder, profile), folder / "server.log")
    yield proc.start()
    proc.stop()


async def status_line(source: HttpSource) -> str:
    """The dashboard's status line once it has failed to connect, at 80x24, checked to
    fit the terminal's width whole."""
    app = Dashboard(source, interval_s=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.connected is False)
        status = app.query_one("#status", Static)
        text = str(status.render())
        assert len(text) <= status.content_region.width, text
        return text


async def test_a_refused_token_is_said_as_such(guarded_server: ServerProcess) -> None:
    assert await status_line(HttpSource(guarded_server.url, "wrong")) == (
        "403: the server refused the token: check --token or INFERGATE_ADMIN_TOKEN"
    )
    # No token sent: none was refused, one is needed.
    assert await status_line(HttpSource(guarded_server.url, None)) == (
        "401: an admin key is needed: give --token or set INFERGATE_ADMIN_TOKEN"
    )


async def test_an_unreachable_server_is_said_in_80_columns() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert await status_line(HttpSource(url, None)) == (
        f"cannot reach {url} (ConnectError); retrying every 0.2 s"
    )


async def test_tenant_view_shows_rate_limit_p99_and_rejections(
    guarded_server: ServerProcess,
) -> None:
    app = Dashboard(HttpSource(guarded_server.url, ADMIN), interval_s=0.2)
    async with app.run_test(size=(140, 42)) as pilot:
        await until(pilot, lambda: app.connected is True)
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
        statuses = []
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TENANT}"}) as http:
            for _ in range(6):
                r = await http.post(f"{guarded_server.url}/v2/models/mlp/infer", json=body)
                statuses.append(r.status_code)
        assert {200, 429} <= set(statuses)
        await pilot.press("t")
        await until(pilot, lambda: isinstance(app.screen, TenantScreen))
        table = app.screen.query_one("#tenant-view", DataTable)

        def row() -> list[str]:
            return [str(c) for c in table.get_row("slowpoke")] if table.row_count else []

        await until(pilot, lambda: bool(row()) and row()[4] == str(statuses.count(429)))
        assert row()[1].endswith("/ 2")  # its rate against its limit
        assert row()[3].startswith("≤ ")  # a p99 from the histogram
        assert row()[6] == "0"  # nothing forbidden
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, TenantScreen))


async def test_a_real_session_screenshot(server: ServerProcess, tmp_path: Path) -> None:
    """The README's picture, from a real server with traffic: INFERGATE_SCREENSHOT=PATH
    writes it there (docs/dashboard.svg)."""
    app = Dashboard(HttpSource(server.url, None), interval_s=0.5)
    async with app.run_test(size=(140, 42)) as pilot:
        await until(pilot, lambda: app.connected is True)
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
        async with httpx.AsyncClient() as http:
            for _ in range(40):
                await http.post(f"{server.url}/v2/models/mlp/infer", json=body)
        label = app.query_one("#rps-label")
        await until(pilot, lambda: "top of scale" in str(label.render()))
        assert app.query_one("#models", DataTable).row_count >= 5
        target = Path(os.environ.get("INFERGATE_SCREENSHOT") or tmp_path / "dashboard.svg")
        app.save_screenshot(filename=target.name, path=str(target.parent.resolve()))
        assert "infergate&#160;top" in target.read_text()
