"""`infergate bench`: a load generator against a running server, in the manner of
perf_analyzer. Throughput and latency count successful requests only; failures are a table
of their own, and any failure makes the exit status 1 unless --allow-errors.

This module is the command and its run; bench_args checks and reads its arguments, and
bench_report prints the results."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from infergate.cli.bench_args import (
    check_options,
    check_shape_names,
    input_data,
    open_csv,
    parse_range,
    parse_shapes,
)
from infergate.cli.bench_report import report
from infergate.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOption,
    TokenOption,
    UrlOption,
    check_model_name,
    check_name,
    client,
    fail,
    fail_client,
    say,
)
from infergate.client_codec import MAX_ANSWER_MB

if TYPE_CHECKING:  # numpy, the client and the load generator load when a bench runs
    from infergate.loadgen import LoadResult, Mode, Plan, Progress, Target


def bench(
    model: Annotated[str, typer.Argument(help="Model name")],
    concurrency: Annotated[
        str,
        typer.Option(
            "--concurrency-range",
            "--concurrency",
            help="Closed loop: concurrent clients, START:END:STEP or a list like 1,8,32",
        ),
    ] = "1",
    rate: Annotated[
        str | None,
        typer.Option(
            "--request-rate-range",
            "--rate",
            help="Open loop instead: requests/s, START:END:STEP or a list like 100,500",
        ),
    ] = None,
    distribution: Annotated[
        str, typer.Option("--request-distribution", help="Open loop arrivals: constant or poisson")
    ] = "constant",
    duration: Annotated[
        float, typer.Option("--duration", "--window", help="Seconds per measurement window")
    ] = 2.0,
    windows: Annotated[
        int | None,
        typer.Option(help="Measure exactly this many windows per level (no stability check)"),
    ] = None,
    stability: Annotated[
        float,
        typer.Option(
            "--stability-percentage",
            help="Repeat windows until the last 3 agree within this many percent",
        ),
    ] = 10.0,
    max_windows: Annotated[
        int, typer.Option(help="Give up on stability after this many windows")
    ] = 10,
    batch: Annotated[int, typer.Option(help="Rows per request along the batch dimension")] = 1,
    input_file: Annotated[
        Path | None,
        typer.Option(
            "--input-data",
            help="Inputs from a .npy (one-input model), an .npz, or a V2 JSON request",
        ),
    ] = None,
    shape: Annotated[
        list[str] | None,
        typer.Option(help="NAME:D1,D2 the dimensions after the batch one (repeatable)"),
    ] = None,
    binary: Annotated[bool, typer.Option(help="Binary tensors (--no-binary: JSON)")] = True,
    priority: Annotated[
        str | None,
        typer.Option(help="parameters.priority: a class name or an integer (1 is highest)"),
    ] = None,
    version: Annotated[str | None, typer.Option("--model-version", help="Model version")] = None,
    max_connections: Annotated[
        int, typer.Option(help="Open loop: connections at most; a send past them fails")
    ] = 512,
    max_answer_mb: Annotated[
        int,
        typer.Option(
            "--max-answer-mb",
            min=1,
            help="The largest answer, in MB, by its Content-Length; a larger one is a failed "
            "request, unread",
        ),
    ] = MAX_ANSWER_MB,
    allow_errors: Annotated[
        bool, typer.Option("--allow-errors", help="Exit 0 even when some requests failed")
    ] = False,
    csv_file: Annotated[
        Path | None, typer.Option("-f", "--csv", help="Also write one CSV row per level here")
    ] = None,
    progress: Annotated[
        bool | None,
        typer.Option(
            help="A live progress line on stderr [default: when stderr is a terminal]",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Drive load at a model: throughput and p50/p90/p95/p99/avg/max latency of the
    successful requests, failures by status with the server's error text, and the
    server's own queue and compute time."""
    check_options(
        duration=duration,
        batch=batch,
        max_connections=max_connections,
        max_windows=max_windows,
        windows=windows,
        stability=stability,
        distribution=distribution,
        as_json=json,
    )
    mode: Mode = "rate" if rate is not None else "concurrency"
    levels = (
        parse_range(rate, "--request-rate-range", integer=False)
        if rate is not None
        else parse_range(concurrency, "--concurrency-range", integer=True)
    )
    shapes = parse_shapes(shape or [])
    check_model_name(model, json)
    if version is not None:
        check_name("model version", version, json)
    from infergate.client import ClientError, model_path
    from infergate.loadgen import Plan, Target, prepare, sample_inputs
    from infergate.loadgen_inputs import InputsTooLarge

    try:
        with client(url, token, json) as c:
            metadata = c.metadata(model, version)
            base = c.url
            headers_auth = dict(c.auth_headers)
    except ClientError as exc:
        fail_client(exc, json)
    check_shape_names(shapes, metadata)
    parameters: dict[str, Any] = {}
    if input_file is not None:
        inputs, parameters = input_data(input_file, metadata)
    else:
        try:
            inputs = sample_inputs(metadata, batch, shapes=shapes)
        except InputsTooLarge as exc:
            if not exc.from_metadata:
                fail(str(exc), EXIT_USAGE, json)
            fail(_odd_metadata(base, model, version, str(exc)), EXIT_FAILURE, json)
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE, json)
    csv_out = open_csv(csv_file, json)  # before the run: a bad path must not waste it
    if priority is not None:
        parameters["priority"] = int(priority) if priority.isdigit() else priority
    body, headers = prepare(inputs, binary, parameters)
    headers.update(headers_auth)
    path = model_path(model, version) + "/infer"
    plan = Plan(
        window_s=duration,
        windows=windows,
        stability_pct=stability,
        max_windows=max_windows,
        max_connections=max_connections,
        distribution="poisson" if distribution == "poisson" else "constant",
        max_answer_mb=max_answer_mb,
    )
    show = sys.stderr.isatty() if progress is None else progress
    results = _run_levels(Target(base, path, body, headers, model), mode, levels, plan, show)
    rows = int(inputs[next(iter(inputs))].shape[0]) if inputs else batch
    report(model, version, mode, plan, rows, binary, results, json, csv_out)
    empty = [r for r in results if r.requests == 0]
    for r in empty:  # a level that measured nothing is no result, whatever it shows
        say(
            f"error: {mode} {r.level:g}: no request was answered or due within the measured "
            "windows, so nothing was measured. Hint: longer windows (--duration), or a "
            "higher rate",
            err=True,
        )
    if empty or any(r.failed for r in results) and not allow_errors:
        raise typer.Exit(EXIT_FAILURE)


def _odd_metadata(base: str, model: str, version: str | None, what: str) -> str:
    """A model's metadata bench cannot make inputs for, as the server's answer."""
    from infergate.client import model_path

    return (
        f"{base} answered GET {model_path(model, version)} with metadata bench cannot make "
        f"random inputs for: {what}. Hint: is the model's metadata right? --input-data FILE "
        "sends inputs of any size"
    )


def _run_levels(
    target: Target, mode: Mode, levels: list[float], plan: Plan, show: bool
) -> list[LoadResult]:
    from infergate.loadgen import run as run_load
    from infergate.loadgen import run_level
    from infergate.server_split import server_split_reader

    shown = [-1]  # off a terminal (a log file), one line a second, not one a tick

    def line(p: Progress) -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\r\033[K" + p.line())
        elif int(p.elapsed_s) != shown[0]:
            shown[0] = int(p.elapsed_s)
            sys.stderr.write(p.line() + "\n")
        sys.stderr.flush()

    reader = server_split_reader(target)
    results = []
    for level in levels:
        results.append(
            run_load(run_level(target, mode, level, plan, line if show else None, reader))
        )
        if show and sys.stderr.isatty():
            sys.stderr.write("\r\033[K")
    return results
