"""`infergate bench`: a load generator against a running server, in the manner of
perf_analyzer."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from infergate.cli.common import (
    EXIT_USAGE,
    JsonOption,
    TokenOption,
    UrlOption,
    client,
    console,
    err_console,
    fail,
    fail_client,
    print_json,
)
from infergate.client import ClientError
from infergate.loadgen import LoadResult, prepare, run_concurrency, run_rate, sample_inputs
from infergate.loadgen import run as run_load


def _levels(text: str, what: str) -> list[float]:
    try:
        levels = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"{what}: expected numbers separated by commas, got {text!r}"
        ) from None
    if not levels or any(x <= 0 for x in levels):
        raise typer.BadParameter(f"{what}: expected positive numbers, got {text!r}")
    return levels


def bench(
    model: Annotated[str, typer.Argument(help="Model name")],
    concurrency: Annotated[
        str, typer.Option(help="Closed loop: concurrent clients, or a sweep like 1,8,32")
    ] = "1",
    rate: Annotated[
        str | None, typer.Option(help="Open loop instead: requests/s, or a sweep like 100,500")
    ] = None,
    duration: Annotated[float, typer.Option(help="Seconds per level")] = 5.0,
    batch: Annotated[int, typer.Option(help="Rows per request along the batch dimension")] = 1,
    binary: Annotated[bool, typer.Option(help="Binary tensors (--no-binary: JSON)")] = True,
    priority: Annotated[
        str | None,
        typer.Option(help="parameters.priority: a class name or an integer (1 is highest)"),
    ] = None,
    version: Annotated[str | None, typer.Option("--version", "-v", help="Model version")] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Drive load at a model and report requests/s, p50/p90/p99 and errors by status."""
    if duration <= 0 or batch < 1:
        fail("--duration must be positive and --batch at least 1", EXIT_USAGE, json)
    mode = "rate" if rate is not None else "concurrency"
    levels = _levels(rate, "--rate") if rate is not None else _levels(concurrency, "--concurrency")
    try:
        with client(url, token) as c:
            metadata = c.metadata(model, version)
            base = c.url
            headers_auth = dict(c.auth_headers)
    except ClientError as exc:
        fail_client(exc, json)
    parameters: dict[str, object] = {}
    if priority is not None:
        parameters["priority"] = int(priority) if priority.isdigit() else priority
    body, headers = prepare(sample_inputs(metadata, batch), binary, parameters)
    headers.update(headers_auth)
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    results = _run_levels(base, path, body, headers, mode, levels, duration, quiet=json)
    if json:
        print_json([asdict(r) for r in results])
    else:
        _table(model, results, batch, binary)
    if any(r.ok == 0 for r in results):
        raise typer.Exit(1)


def _run_levels(
    url: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    mode: str,
    levels: list[float],
    duration: float,
    quiet: bool,
) -> list[LoadResult]:
    results = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeRemainingColumn(),
        console=err_console,
        disable=quiet,
        transient=True,
    ) as progress:
        for level in levels:
            label = f"{mode} {level:g}"
            task = progress.add_task(label, total=duration)

            def tick(done: float, task: TaskID = task) -> None:
                progress.update(task, completed=done)

            if mode == "rate":
                load = run_rate(url, path, body, headers, level, duration, tick)
            else:
                load = run_concurrency(url, path, body, headers, int(level), duration, tick)
            results.append(run_load(load))
            progress.update(task, completed=duration)
    return results


def _table(model: str, results: list[LoadResult], batch: int, binary: bool) -> None:
    kind = "binary" if binary else "JSON"
    table = Table(
        f"{results[0].mode}",
        "requests",
        "req/s",
        "rows/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "errors",
        title=f"{model}: batch {batch}, {kind} tensors",
    )
    for r in results:
        errors = (
            ", ".join(f"{'no answer' if s == 0 else s}: {n}" for s, n in sorted(r.errors.items()))
            or "-"
        )
        table.add_row(
            f"{r.level:g}",
            str(r.requests),
            f"{r.rps:.0f}",
            f"{r.rps * batch:.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p90_ms:.2f}",
            f"{r.p99_ms:.2f}",
            errors,
        )
    console.print(table)
