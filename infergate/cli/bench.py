"""`infergate bench`: a load generator against a running server, in the manner of
perf_analyzer. Throughput and latency count successful requests only; failures are a table
of their own, and any failure makes the exit status 1 unless --allow-errors."""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import orjson
import typer
from rich.text import Text

from infergate.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOption,
    TokenOption,
    UrlOption,
    check_name,
    client,
    emit_table,
    fail,
    fail_client,
    print_json,
    say,
)
from infergate.cli.common import (
    Format as OutputFormat,
)

if TYPE_CHECKING:  # numpy, the client and the load generator load when a bench runs
    from infergate.loadgen import LoadResult, Mode, Plan, Progress, Target
    from infergate.tensors import Array

SCHEMA_VERSION = 1
MAX_LEVELS = 1000  # a range that makes more is a typo (1:1000000), not a plan
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


def parse_range(text: str, what: str, integer: bool) -> list[float]:
    """perf_analyzer's START:END:STEP (END and STEP optional), or a list like 1,8,32."""
    try:
        if ":" in text:
            parts = [float(x) for x in text.split(":")]
            if len(parts) > 3 or not all(math.isfinite(x) for x in parts):
                raise ValueError
            start, end, step = (parts + [parts[0], 1.0][len(parts) - 1 :])[:3]
            if step <= 0 or end < start:
                raise ValueError
            count = int((end - start) / step + 1e-9) + 1
            if count > MAX_LEVELS:
                raise typer.BadParameter(
                    f"{what}: {text!r} makes {count} levels; at most {MAX_LEVELS}. Hint: a "
                    "larger STEP"
                )
            levels = [start + i * step for i in range(count)]
        else:
            levels = [float(x) for x in text.split(",") if x.strip()]
            if not all(math.isfinite(x) for x in levels):
                raise ValueError
    except ValueError:
        raise typer.BadParameter(
            f"{what}: expected START:END:STEP (like 1:16:4) or numbers separated by commas "
            f"(like 1,8,32), got {text!r}"
        ) from None
    if not levels or any(x <= 0 for x in levels):
        raise typer.BadParameter(f"{what}: expected positive numbers, got {text!r}")
    if integer and any(x != int(x) for x in levels):
        raise typer.BadParameter(f"{what}: a concurrency is a whole number, got {text!r}")
    return levels


def _check_shape_names(shapes: dict[str, tuple[int, ...]], metadata: dict[str, Any]) -> None:
    names = [t["name"] for t in metadata.get("inputs") or []]
    for name in shapes:
        if name not in names:
            raise typer.BadParameter(
                f"--shape {name}:...: the model has no input {name!r}; its inputs are "
                f"{', '.join(names) or 'none'}"
            )


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            raise typer.BadParameter(
                f"--shape {item!r}: expected NAME:D1,D2,... (the dimensions after the batch "
                "one, like input:64)"
            ) from None
    return shapes


def _v2_request(path: Path) -> tuple[dict[str, Array], dict[str, Any]]:
    """The inputs and parameters of a V2 JSON request file."""
    import numpy as np

    from infergate.tensors import numpy_dtype

    try:
        doc = orjson.loads(path.read_bytes())
        if not isinstance(doc, dict):
            raise TypeError(f"the file holds a JSON {type(doc).__name__}, not an object")
        inputs: dict[str, Array] = {}
        for t in doc["inputs"]:
            if t["datatype"] == "BYTES":
                flat = [s.encode() if isinstance(s, str) else s for s in t["data"]]
                array = np.array(flat, dtype=object)
            else:
                array = np.array(t["data"], dtype=numpy_dtype(t["datatype"]))
            inputs[t["name"]] = array.reshape(t["shape"])
        parameters = doc.get("parameters") or {}
        return inputs, dict(parameters) if isinstance(parameters, dict) else {}
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise typer.BadParameter(
            f"{path}: not a V2 inference request ({type(exc).__name__}: {exc}). Hint: "
            '{"inputs": [{"name": ..., "datatype": ..., "shape": [...], "data": [...]}]}'
        ) from None


def input_data(path: Path, metadata: dict[str, Any]) -> tuple[dict[str, Array], dict[str, Any]]:
    """--input-data: a .npy (a one-input model), an .npz (arrays named as the inputs), or a
    V2 JSON request."""
    from infergate.cli.npy import sendable

    inputs, parameters = _input_data(path, metadata)
    return {
        n: sendable(f"--input-data {path}: input {n}", a) for n, a in inputs.items()
    }, parameters


def _input_data(path: Path, metadata: dict[str, Any]) -> tuple[dict[str, Array], dict[str, Any]]:
    from infergate.cli.npy import load_npy, load_npz

    if not path.exists():
        raise typer.BadParameter(f"--input-data {path}: no such file")
    if not path.is_file():
        raise typer.BadParameter(f"--input-data {path}: not a regular file (a directory?)")
    names = [t["name"] for t in metadata.get("inputs") or []]
    if path.suffix == ".npy":
        if len(names) != 1:
            raise typer.BadParameter(
                f"--input-data {path}: a .npy feeds a one-input model; this one has "
                f"{', '.join(names)}. Hint: an .npz with one array per input"
            )
        return _batched({names[0]: load_npy(path)}, metadata), {}
    if path.suffix == ".npz":
        return _batched(load_npz(path), metadata), {}
    if path.suffix == ".json":
        return _v2_request(path)
    raise typer.BadParameter(f"--input-data {path}: expected a .npy, .npz or .json file")


def _batched(inputs: dict[str, Array], metadata: dict[str, Any]) -> dict[str, Array]:
    """A single sample (one dimension short of a batching model's shape) becomes a batch of
    one, as `infergate infer` does."""
    import numpy as np

    dims = {t["name"]: t["shape"] for t in metadata.get("inputs") or []}
    out = {}
    for name, array in inputs.items():
        shape = dims.get(name)
        if shape and shape[0] < 0 and array.ndim == len(shape) - 1:
            array = array[np.newaxis]
        out[name] = array
    return out


def _level_doc(r: LoadResult) -> dict[str, Any]:
    doc = asdict(r)
    doc["failures"] = [asdict(f) for f in r.failures]
    return doc


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
    if not 0 < duration < math.inf or batch < 1 or max_connections < 1 or max_windows < 3:
        fail(
            "--duration must be a positive number of seconds (not inf), --batch and "
            "--max-connections at least 1, "
            "--max-windows at least 3",
            EXIT_USAGE,
            json,
        )
    if windows is not None and windows < 1:
        fail("--windows must be at least 1", EXIT_USAGE, json)
    if not 0 < stability < math.inf:
        fail("--stability-percentage must be a positive number", EXIT_USAGE, json)
    if distribution not in ("constant", "poisson"):
        fail(f"--request-distribution {distribution!r}: constant or poisson", EXIT_USAGE, json)
    mode: Mode = "rate" if rate is not None else "concurrency"
    levels = (
        parse_range(rate, "--request-rate-range", integer=False)
        if rate is not None
        else parse_range(concurrency, "--concurrency-range", integer=True)
    )
    shapes = parse_shapes(shape or [])
    check_name("model", model, json)
    if version is not None:
        check_name("model version", version, json)
    from infergate.client import ClientError, model_path
    from infergate.loadgen import Plan, Target, prepare, sample_inputs

    try:
        with client(url, token, json) as c:
            metadata = c.metadata(model, version)
            base = c.url
            headers_auth = dict(c.auth_headers)
    except ClientError as exc:
        fail_client(exc, json)
    _check_shape_names(shapes, metadata)
    parameters: dict[str, Any] = {}
    if input_file is not None:
        inputs, parameters = input_data(input_file, metadata)
    else:
        try:
            inputs = sample_inputs(metadata, batch, shapes=shapes)
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE, json)
    csv_out = _open_csv(csv_file, json)  # before the run: a bad path must not waste it
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
    )
    show = sys.stderr.isatty() if progress is None else progress
    results = _run_levels(Target(base, path, body, headers, model), mode, levels, plan, show)
    rows = int(inputs[next(iter(inputs))].shape[0]) if inputs else batch
    _report(model, version, mode, plan, rows, binary, results, json, csv_out)
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


def _open_csv(path: Path | None, as_json: bool) -> IO[str] | None:
    if path is None:
        return None
    try:
        return path.open("w", newline="")
    except OSError as exc:
        fail(f"-f {path}: cannot write it ({exc.strerror or exc})", EXIT_USAGE, as_json)


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


def _report(
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
