"""What `infergate bench` prints of its results: tables for people (levels, then the
failures, which the first table does not count), one JSON document (--json, schema
SCHEMA_VERSION), and one CSV row per level (-f)."""

from __future__ import annotations

import csv
from dataclasses import asdict
from typing import IO, TYPE_CHECKING, Any

from rich.text import Text

from infergate.cli.common import Format as OutputFormat
from infergate.cli.common import emit_table, print_json, say

if TYPE_CHECKING:
    from infergate.loadgen import LoadResult, Mode, Plan

SCHEMA_VERSION = 1
CSV_COLUMNS = [
    "mode",
    "level",
    "requests",
    "ok",
    "failed",
    "seconds",
    "throughput_rps",
    "p50_ms",
    "p90_ms",
    "p95_ms",
    "p99_ms",
    "avg_ms",
    "max_ms",
    "server_queue_ms",
    "server_compute_ms",
    "windows",
    "windows_measured",
    "stable",
]


def _level_doc(r: LoadResult) -> dict[str, Any]:
    doc = asdict(r)
    doc["failures"] = [asdict(f) for f in r.failures]
    return doc


def report(
    model: str,
    version: str | None,
    mode: Mode,
    plan: Plan,
    rows: int,
    binary: bool,
    results: list[LoadResult],
    json: bool,
    csv_out: IO[str] | None,
) -> None:
    """The results as one JSON document or as tables, and as CSV rows when -f was given."""
    if csv_out is not None:
        with csv_out:
            _write_csv(csv_out, results)
    if json:
        print_json(
            {
                "schema": SCHEMA_VERSION,
                "model": model,
                "version": version,
                "mode": mode,
                "distribution": plan.distribution if mode == "rate" else None,
                "rows_per_request": rows,
                "transport": "binary" if binary else "json",
                "window_s": plan.window_s,
                "levels": [_level_doc(r) for r in results],
            }
        )
        return
    _tables(model, mode, rows, binary, results)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _windows(r: LoadResult) -> str:
    if r.stable is None:
        return str(r.windows)
    return f"last {r.windows} of {r.windows_measured}, " + ("stable" if r.stable else "NOT stable")


def _tables(model: str, mode: Mode, rows: int, binary: bool, results: list[LoadResult]) -> None:
    kind = "binary" if binary else "JSON"
    say(f"{model}: {rows} row(s) per request, {kind} tensors; successful requests only")
    table_rows: list[list[str | Text]] = []
    for r in results:
        lat = r.latency_ms
        table_rows.append(
            [
                f"{r.level:g}",
                str(r.ok),
                Text(str(r.failed), style="red" if r.failed else ""),
                f"{r.throughput_rps:.1f}",
                f"{r.throughput_rps * rows:.0f}",
                *(
                    [_ms(lat.p50), _ms(lat.p90), _ms(lat.p95), _ms(lat.p99), _ms(lat.avg)]
                    if lat
                    else ["-"] * 5
                ),
                _ms(lat.max if lat else None),
                _ms(r.server.queue_ms if r.server else None),
                _ms(r.server.compute_ms if r.server else None),
                _windows(r),
            ]
        )
    emit_table(
        [
            mode,
            "ok",
            "failed",
            "req/s",
            "rows/s",
            "p50 ms",
            "p90 ms",
            "p95 ms",
            "p99 ms",
            "avg ms",
            "max ms",
            "server queue ms",
            "server compute ms",
            "windows",
        ],
        table_rows,
        OutputFormat.table,
    )
    failures = [(r, f) for r in results for f in r.failures]
    if failures:
        say("failures (not counted above):")
        emit_table(
            [mode, "status", "count", "error"],
            [
                [
                    f"{r.level:g}",
                    str(f.status) if f.status is not None else f.kind.replace("_", " "),
                    str(f.count),
                    f.error,
                ]
                for r, f in failures
            ],
            OutputFormat.table,
        )
    unstable = [r for r in results if r.stable is False]
    if unstable:
        say(
            f"note: {len(unstable)} level(s) did not settle within the windows measured; "
            "longer windows (--duration) or more of them (--max-windows) may help",
            err=True,
        )


def _write_csv(f: IO[str], results: list[LoadResult]) -> None:
    writer = csv.writer(f)
    writer.writerow(CSV_COLUMNS)
    for r in results:
        lat = r.latency_ms
        writer.writerow(
            [
                r.mode,
                f"{r.level:g}",
                r.requests,
                r.ok,
                r.failed,
                f"{r.seconds:.3f}",
                f"{r.throughput_rps:.3f}",
                *(
                    [f"{x:.3f}" for x in (lat.p50, lat.p90, lat.p95, lat.p99, lat.avg, lat.max)]
                    if lat
                    else [""] * 6
                ),
                "" if not r.server or r.server.queue_ms is None else f"{r.server.queue_ms:.3f}",
                "" if not r.server or r.server.compute_ms is None else f"{r.server.compute_ms:.3f}",
                r.windows,
                r.windows_measured,
                "" if r.stable is None else str(r.stable).lower(),
            ]
        )
