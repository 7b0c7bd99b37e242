"""The dashboard: devices, models (state, breaker, queues, rates, latencies), tenants,
throughput and p99 over the last minutes, and the event log. Keys: q quit, r reset the
selected model's breaker, l/u load or unload it (each after a confirmation that defaults to
No), t the per-tenant view, ? help. The models table has the focus from the start.

It polls /admin/stats once a second in a worker (not while a poll is still out: a slow
server gets the source's whole deadline, and is said to be slow); when the server goes away
it says so (a refused token is said as such), keeps the last picture, and reconnects by
itself. Every field is read with a default, so a server that lacks one is shown, not
crashed on. Everything from the server is shown as written, never parsed as markup (every
table cell is a Text), with its control characters escaped (fields.shown and fields.cell).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen, Screen
from textual.timer import Timer
from textual.widgets import Button, DataTable, Footer, Header, Label, RichLog, Sparkline, Static
from textual.worker import Worker

from infergate.client_errors import escape_controls
from infergate.tui.fields import (
    cell,
    clock_time,
    mapping,
    number,
    plot_value,
    records,
    shown,
    text,
)
from infergate.tui.fields import (
    shown_number as _num,
)
from infergate.tui.source import SourceError, StatsSource
from infergate.tui.tenants import TenantLatency, TenantScreen, tenant_rows

STATE_STYLE = {
    "ready": "green",
    "loading": "yellow",
    "restarting": "yellow",
    "failed": "red",
    "unavailable": "red",
    "unloaded": "dim",
    "stopped": "dim",
}
BREAKER_STYLE = {"closed": "green", "half_open": "yellow", "open": "bold red"}


def _bar(used: float, total: float, width: int = 20) -> str:
    share = 0.0 if total <= 0 else min(1.0, used / total)
    filled = round(share * width)
    return "█" * filled + "░" * (width - filled)


def _event_key(event: dict[str, Any]) -> tuple[str, float]:
    """An event is known by its id and time together: a restarted server numbers its events
    from 1 again."""
    return text(event.get("id"), "0"), number(event.get("time"))


class ConfirmScreen(ModalScreen[bool]):
    """Yes or No, with No focused: Enter on its own never changes anything."""

    BINDINGS = [
        Binding("escape,n", "answer(False)", "No"),
        Binding("y", "answer(True)", "Yes"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self._question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self._question, markup=False)
            with Horizontal():
                yield Button("No", variant="primary", id="no")
                yield Button("Yes", variant="warning", id="yes")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


HELP = (
    "infergate top\n\n"
    "  q   quit\n"
    "  r   reset the selected model's circuit breaker\n"
    "  l   load (or reload) the selected model\n"
    "  u   unload the selected model\n"
    "  t   tenants: rate against limit, in flight, p99, rejections\n"
    "  ?   this help\n\n"
    "Arrow keys select a model; r, l and u ask first (No is the default).\n"
    "Data refreshes every second."
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(HELP, markup=False)
            yield Button("Close", id="close")

    def on_button_pressed(self, _: Button.Pressed) -> None:
        self.dismiss()


class Dashboard(App[None]):
    CSS_PATH = "dashboard.tcss"
    TITLE = "infergate top"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("r", "reset_breaker", "Reset breaker"),
        Binding("l", "load", "Load"),
        Binding("u", "unload", "Unload"),
        Binding("t", "tenants", "Tenants"),
        Binding("question_mark", "help", "Help"),
    ]

    def __init__(
        self,
        source: StatsSource,
        interval_s: float = 1.0,
        clock: Callable[[], str] = lambda: time.strftime("%H:%M:%S"),
    ) -> None:
        super().__init__()
        self.source = source
        self._clock = clock
        self.interval_s = interval_s
        self.connected: bool | None = None
        self.stats: dict[str, Any] = {}
        self._seen_events: set[tuple[str, float]] = set()  # (id, time): ids restart with the server
        self._poller: Timer | None = None
        self._polling: Worker[None] | None = None  # the poll out now, if one is
        self.tenant_latency = TenantLatency()

    # What acts on the models table (and opens a view over it): only while it is shown.
    MAIN_VIEW_ACTIONS = frozenset({"reset_breaker", "load", "unload", "tenants"})

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Keys of a hidden view do nothing: with the tenants view (or a dialog) open, `u`
        must not ask to unload the model selected underneath it."""
        return action not in self.MAIN_VIEW_ACTIONS or self.screen is self.screen_stack[0]

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="main"):
            with Horizontal(id="top"):
                yield Static("devices: waiting for data", id="devices", markup=False)
                yield DataTable(id="tenants", cursor_type="none", zebra_stripes=True)
            yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
            with Horizontal(id="plots"):
                with Vertical(classes="plot"):
                    yield Label("requests/s: no data yet", id="rps-label", markup=False)
                    yield Sparkline([], id="rps")
                with Vertical(classes="plot"):
                    yield Label("p99 ms: no data yet", id="p99-label", markup=False)
                    yield Sparkline([], id="p99")
            yield RichLog(id="events", markup=False, wrap=False, max_lines=500)
        with Vertical(id="bottom"):
            yield Static(f"connecting to {self.source.label}", id="status", markup=False)
            yield Footer()

    def on_mount(self) -> None:
        models = self.query_one("#models", DataTable)
        models.add_columns(
            "model",
            "version",
            "state",
            "instances",
            "breaker",
            "queue",
            "req/s",
            "p50 ms",
            "p99 ms",
            "errors",
            "reason",
        )
        tenants = self.query_one("#tenants", DataTable)
        tenants.add_columns(
            "tenant", "class", "req/s of limit", "in flight", "memory MB", "admitted", "rejected"
        )
        tenants.can_focus = False  # the arrow keys belong to the models table
        models.focus()
        self._tick()
        self._poller = self.set_interval(self.interval_s, self._tick)

    def _tick(self) -> None:
        """The timer's poll, unless one is still out: the next would cancel it (the poll is
        exclusive), and a server slower than a tick would never be said to be slow."""
        if self._polling is None or self._polling.is_finished:
            self._polling = self.poll()

    async def on_unmount(self) -> None:
        # No poll may use the client once it is closed: stop the timer, end a poll in
        # flight (closing mid-fetch failed the app with "the client has been closed").
        if self._poller is not None:
            self._poller.stop()
        self.workers.cancel_group(self, "poll")
        await self.source.close()

    @work(exclusive=True, group="poll")
    async def poll(self) -> None:
        try:
            stats = await self.source.fetch()
        except SourceError as exc:
            self._disconnected(exc)
            return
        try:
            self._connected(stats)
        except NoMatches:
            return  # the app is closing: nothing left to draw on
        except Exception as exc:  # data no field reader foresaw: said, never a crash
            said = " ".join(str(exc).split())
            why = f"data the dashboard cannot show ({type(exc).__name__}: {said})"
            self._disconnected(SourceError(why))

    def _connected(self, stats: dict[str, Any]) -> None:
        self.connected = True
        self.stats = stats
        status = self.query_one("#status", Static)
        status.remove_class("down")
        label = escape_controls(self.source.label)
        status.update(f"connected to {label} · updated {self._clock()} · ? for help")
        self._show(stats)

    def _disconnected(self, error: SourceError) -> None:
        self.connected = False
        try:
            status = self.query_one("#status", Static)
        except NoMatches:
            return  # the app is closing
        status.add_class("down")
        # One line that fits 80 columns; the last picture stays on screen either way.
        if error.status in (401, 403):
            line = str(error)
        else:
            line = f"{error}; retrying every {self.interval_s:g} s"
        line = escape_controls(" ".join(line.split()))  # a server's text may hold newlines
        width = status.content_region.width or 80
        status.update(line if len(line) <= width else line[: width - 1].rstrip() + "…")

    def _show(self, stats: dict[str, Any]) -> None:
        self._show_devices(records(stats.get("devices")), records(stats.get("workers")))
        self._show_models(records(stats.get("models")))
        self._show_tenants(records(stats.get("tenants")))
        history = records(stats.get("throughput"))
        self._show_plot("rps", "requests/s", [plot_value(h.get("rps")) for h in history], "{:.0f}")
        self._show_plot("p99", "p99 ms", [plot_value(h.get("p99_ms")) for h in history], "{:.1f}")
        if isinstance(stats.get("tenant_latency"), dict):
            self.tenant_latency.add(stats["tenant_latency"])
        if isinstance(self.screen, TenantScreen):
            self.screen.update_rows(tenant_rows(stats, self.tenant_latency))
        self._show_events(records(stats.get("events")))

    def _show_plot(self, name: str, what: str, values: list[float], fmt: str) -> None:
        """A sparkline has no axis: its label gives the unit, the span, the scale (the
        highest point) and the latest value. No traffic draws nothing, not a bar."""
        plot = self.query_one(f"#{name}", Sparkline)
        label = self.query_one(f"#{name}-label", Label)
        if not any(values):
            plot.data = []
            label.update(f"{what}: no requests in the last {len(values) or 120} s")
            return
        plot.data = values
        span = len(values) // 60
        label.update(
            f"{what}, last {span} min: now {fmt.format(values[-1])}, "
            f"top of scale {fmt.format(max(values))}"
        )

    def _show_devices(self, devices: list[dict[str, Any]], workers: list[dict[str, Any]]) -> None:
        lines = []
        for d in devices:
            total, used = number(d.get("memory_total_mb")), number(d.get("memory_used_mb"))
            lines.append(
                f"{shown(d.get('name'), '?')}  util {_num(d.get('utilization'), '{:.0f}')}%"
            )
            lines.append(
                f"  mem {_bar(used, total)} {_num(used / 1024, '{:.1f}')}/"
                f"{_num(total / 1024, '{:.1f}')} GiB"
            )
        for w in workers:
            lines.append(
                f"  {shown(w.get('model'), '?')} v{shown(w.get('version'), '?')}#"
                f"{shown(w.get('instance'), '0')} pid {shown(w.get('pid') or '-')} "
                f"{_num(w.get('memory_mb'), '{:.0f}')} MiB"
            )
        self.query_one("#devices", Static).update("\n".join(lines) or "no devices reported")

    def _show_models(self, models: list[dict[str, Any]]) -> None:
        table = self.query_one("#models", DataTable)
        selected = self.selected_model()
        table.clear()
        keys: set[str] = set()
        for m in models:
            name = text(m.get("name"), "?")
            key = name if "name" in m and name not in keys else None  # a row key is unique
            keys.add(name)
            state = text(m.get("state"), "?")
            breaker = text(m.get("breaker")) or "-"
            queue = mapping(m.get("queue"))
            queued = " ".join(f"{k[:2]}:{v}" for k, v in sorted(queue.items())) or "0"
            versions = m.get("versions")
            listed = ",".join(map(str, versions)) if isinstance(versions, list) else ""
            table.add_row(  # every cell a Text (cell): a str cell is read as markup
                cell(name),
                cell(listed or "-"),
                cell(state, STATE_STYLE.get(state, "")),
                cell(f"{m.get('instances_ready', 0)}/{m.get('instances', 0)}"),
                cell(breaker, BREAKER_STYLE.get(breaker, "")),
                cell(queued),
                cell(_num(m.get("rps"))),
                cell(_num(m.get("p50_ms"), "{:.2f}")),
                cell(_num(m.get("p99_ms"), "{:.2f}")),
                cell(m.get("errors", 0)),
                cell(shown(m.get("reason"))[:60]),
                key=key,
            )
        if selected is not None and selected in keys:
            table.move_cursor(row=table.get_row_index(selected))

    def _show_tenants(self, tenants: list[dict[str, Any]]) -> None:
        table = self.query_one("#tenants", DataTable)
        table.clear()
        for t in tenants:
            memory = (
                f"{_num(t.get('reserved_mb'), '{:.0f}')} / {_num(t.get('memory_mb'), '{:.0f}')}"
            )
            table.add_row(
                cell(text(t.get("name"), "?")),
                cell(text(t.get("class"), "-")),
                cell(f"{_num(t.get('rps'))} / {_num(t.get('rps_limit'), '{:g}')}"),
                cell(f"{t.get('in_flight', 0)}/{_num(t.get('max_concurrency'), '{}')}"),
                cell(memory),
                cell(t.get("admitted", 0)),
                cell(t.get("rejected", 0)),
            )

    def _show_events(self, events: list[dict[str, Any]]) -> None:
        """New events, in order. An event is known by its id and time together: a restarted
        server numbers its events from 1 again."""
        log = self.query_one("#events", RichLog)
        for e in sorted(events, key=lambda e: (number(e.get("time")), number(e.get("id")))):
            key = _event_key(e)
            if key in self._seen_events:
                continue
            self._seen_events.add(key)
            stamp = clock_time(e.get("time"))
            version = f" v{e['version']}" if e.get("version") else ""
            kind = text(e.get("kind"), "?")
            style = "red" if ("fail" in kind or "open" in kind or "reject" in kind) else ""
            line = f"{stamp} {kind} {text(e.get('model'))}{version}: {text(e.get('message'))}"
            log.write(Text(escape_controls(line), style=style))
        if len(self._seen_events) > 5000:  # the server sends its last 30; forget old ones
            self._seen_events = {_event_key(e) for e in events}

    def selected_model(self) -> str | None:
        table = self.query_one("#models", DataTable)
        if table.row_count == 0:
            return None
        try:
            row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        except Exception:  # an empty or changing table has no valid cursor
            return None
        return str(row_key.value) if row_key.value is not None else None

    async def _act(self, what: str, model: str) -> None:
        try:
            if what == "reset":
                await self.source.reset_breaker(model)
            elif what == "load":
                await self.source.load(model)
            else:
                await self.source.unload(model)
        except SourceError as exc:
            said = escape_controls(f"{what} {model} failed: {exc}")
            self.notify(said, severity="error", markup=False)
            return
        self.notify(escape_controls(f"{what} {model}: done"), markup=False)
        self._polling = self.poll()

    @work(group="actions")
    async def action_reset_breaker(self) -> None:
        model = self.selected_model()
        if model and await self._confirm(f"Reset the circuit breaker of {model}?"):
            await self._act("reset", model)

    async def _confirm(self, question: str) -> bool:
        screen: Screen[Any] = ConfirmScreen(escape_controls(question))  # (it names a model)
        return bool(await self.push_screen_wait(screen))

    @work(group="actions")
    async def action_load(self) -> None:
        model = self.selected_model()
        if model and await self._confirm(f"Load (or reload) {model}?"):
            await self._act("load", model)

    @work(group="actions")
    async def action_unload(self) -> None:
        model = self.selected_model()
        question = f"Unload {model}? Its workers stop; requests get 404 until it is loaded again."
        if model and await self._confirm(question):
            await self._act("unload", model)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_tenants(self) -> None:
        self.push_screen(TenantScreen(tenant_rows(self.stats, self.tenant_latency)))
