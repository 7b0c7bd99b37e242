"""The per-tenant view: each tenant's rate against its limit, what it has in flight (its
queue), its p99 and its rejections by reason. The p99 comes from the request duration
histogram on /metrics, over the last ten seconds, as the upper bound of the bucket it falls
in (so it reads "at most")."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from infergate.tui.fields import cell, records, text
from infergate.tui.fields import shown_number as _num

Buckets = dict[float, float]  # le (seconds) -> cumulative count


def quantile_bound(buckets: Buckets, q: float) -> float | None:
    """The upper bound, in ms, of the bucket where the q-quantile falls; None if empty."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    for le, count in ordered:
        if count >= rank:
            return math.inf if math.isinf(le) else le * 1000
    return math.inf


class TenantLatency:
    """Snapshots of each tenant's histogram; the p99 over the span between the newest and
    the oldest kept (about `keep` polls)."""

    def __init__(self, keep: int = 10) -> None:
        self._snapshots: deque[dict[str, Buckets]] = deque(maxlen=keep + 1)

    def add(self, snapshot: dict[str, Buckets]) -> None:
        snapshot = {t: b for t, b in snapshot.items() if isinstance(b, dict)}
        if self._snapshots and any(
            sum(b.values()) < sum(self._snapshots[-1].get(t, {}).values())
            for t, b in snapshot.items()
        ):
            self._snapshots.clear()  # counters went back: the server restarted
        self._snapshots.append(snapshot)

    def p99_ms(self, tenant: str) -> float | None:
        if not self._snapshots:
            return None
        new = self._snapshots[-1].get(tenant, {})
        old = self._snapshots[0].get(tenant, {}) if len(self._snapshots) > 1 else {}
        return quantile_bound({le: n - old.get(le, 0.0) for le, n in new.items()}, 0.99)


def _p99(value: float | None) -> str:
    if value is None:
        return "-"
    return "> 30 s" if math.isinf(value) else f"≤ {value:g}"


def tenant_rows(stats: dict[str, Any], latency: TenantLatency) -> list[tuple[str, ...]]:
    details = {text(t.get("name")): t for t in records(stats.get("tenant_details"))}
    rows: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for t in records(stats.get("tenants")):
        name = text(t.get("name"), "?")
        if name in seen:  # a row key is unique: the first of a name shows
            continue
        seen.add(name)
        d = details.get(name, {})
        limit = t.get("rps_limit")
        rows.append(
            (
                name,
                f"{_num(t.get('rps'))} / {_num(limit, '{:g}')}",
                f"{t.get('in_flight', 0)} / {_num(t.get('max_concurrency'), '{}')}",
                _p99(latency.p99_ms(name)),
                _num(d.get("rate_limited"), "{:d}"),
                _num(d.get("over_concurrency"), "{:d}"),
                _num(d.get("forbidden"), "{:d}"),
                str(t.get("admitted", 0)),
            )
        )
    return rows


class TenantScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,t", "dismiss", "Close")]

    def __init__(self, rows: list[tuple[str, ...]]) -> None:
        super().__init__()
        self._rows = rows
        self._mounted = False  # columns are added on mount; a poll may come before it

    def compose(self) -> ComposeResult:
        with Vertical(id="tenant-dialog"):
            yield Label("Tenants (last 10 s; Esc closes)")
            yield DataTable(id="tenant-view", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one("#tenant-view", DataTable)
        table.add_columns(
            "tenant",
            "req/s / limit",
            "in flight / max",
            "p99 ms",
            "429 rate",
            "429 concurrency",
            "403",
            "admitted",
        )
        self._mounted = True
        self.update_rows(self._rows)
        table.focus()

    def update_rows(self, rows: list[tuple[str, ...]]) -> None:
        self._rows = rows
        if not self._mounted:  # pushed but not mounted yet: on_mount shows these rows
            return
        table = self.query_one("#tenant-view", DataTable)
        table.clear()
        for row in rows:
            table.add_row(*(cell(c) for c in row), key=row[0])  # as written, no markup
