"""`infergate bench` against a real server: successes only in throughput and latency,
failures by status with the server's text, exit codes, the JSON schema, CSV, inputs from
files, open-loop latency from when a request was due, refused sends, progress."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from infergate import loadgen
from infergate.cli.main import app
from infergate.engine.admission.tenants import hash_key
from infergate.loadgen import Plan, Progress, Target, prepare, run_level, sample_inputs
from tests.conftest import REPO, write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

runner = CliRunner()
LIMITED_KEY = "limited-key"
PROFILE = f"""
[server]
max_request_mb = 1
[tenants.default]
[tenants.limited]
rps = 5
burst = 2
api_keys = ["{hash_key(LIMITED_KEY)}"]
"""
LEVEL_KEYS = {
    "mode",
    "level",
    "requests",
    "ok",
    "failed",
    "seconds",
    "throughput_rps",
    "latency_ms",
    "failures",
    "server",
    "windows",
    "windows_measured",
    "stable",
}


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("bench")
    models = folder / "models"
    make_scripted(models / "slow" / "1" / "model.scripted")
    make_scripted(
        models / "held" / "1" / "model.scripted", controls=("hold",), gate_dir=folder / "gates"
    )
    (models / "slow" / "model.toml").write_text("[batching]\nmax_batch_size = 1\n")
    (models / "digits").mkdir(parents=True)
    for item in (REPO / "models" / "digits").rglob("*"):
        if item.is_file():
            target = models / "digits" / item.relative_to(REPO / "models" / "digits")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(item.read_bytes())
    proc = ServerProcess(models, write_profile(folder, PROFILE), folder / "server.log").start()
    for name in ("slow", "held"):
        # engine/runtimes/__init__.py `_all()` marks plugins loaded before importing them, so
        # a model scanned in another thread meanwhile can miss the scripted runtime ("no
        # model file found"); loading it again once the plugin is in is what a user would do.
        if proc.model(name)["state"] != "ready":
            httpx.post(f"{proc.url}/v2/repository/models/{name}/load", timeout=60)
            proc.wait_model_state(name, "ready")
    yield proc
    proc.stop()


def test_failures_are_their_own_table_and_exit_1(bench_server: ServerProcess) -> None:
    # A short run: the server works flat out for it (its 429s too), and a third of a second
    # at 5 requests/s with a burst of 2 refuses most of what two clients send.
    args = ["bench", "digits", "--concurrency-range", "2", "--duration", "0.3", "--windows", "1"]
    args += ["--url", bench_server.url, "--token", LIMITED_KEY]
    code, out = run(*args)
    assert code == 1, out
    assert "failures (not counted above)" in out
    assert "429" in out
    assert "over its rate of 5 requests/s" in out  # the server's own words
    code, out = run(*args, "--json", "--allow-errors")
    assert code == 0, out
    [level] = json.loads(out)["levels"]
    assert level["failed"] > 0
    assert level["requests"] == level["ok"] + level["failed"]
    # Throughput counts successes only: the bucket lets at most burst + rate x time through.
    assert level["ok"] <= 2 + 5 * (level["seconds"] + 1)
    assert level["throughput_rps"] == pytest.approx(level["ok"] / level["seconds"])
    [failure] = level["failures"]
    assert failure["kind"] == "http"
    assert failure["status"] == 429
    assert failure["count"] == level["failed"]
    assert "over its rate" in failure["error"]


def test_json_schema_csv_and_server_split(bench_server: ServerProcess, tmp_path: Path) -> None:
    out_csv = tmp_path / "out.csv"
    code, out = run(
        "bench",
        "digits",
        "--concurrency-range",
        "1:3:2",
        "--duration",
        "0.2",
        "--windows",
        "2",
        "-f",
        str(out_csv),
        "--url",
        bench_server.url,
        "--json",
    )
    assert code == 0, out
    doc = json.loads(out)
    assert set(doc) == {
        "schema",
        "model",
        "version",
        "mode",
        "distribution",
        "rows_per_request",
        "transport",
        "window_s",
        "levels",
    }
    assert (doc["schema"], doc["version"], doc["distribution"]) == (1, None, None)
    assert [lv["level"] for lv in doc["levels"]] == [1, 3]
    for lv in doc["levels"]:
        assert set(lv) == LEVEL_KEYS
        assert (lv["failed"], lv["failures"], lv["windows"], lv["stable"]) == (0, [], 2, None)
        lat = lv["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert lat["avg"] <= lat["max"]
        assert lv["server"]["queue_ms"] >= 0
        assert lv["server"]["compute_ms"] > 0
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["level"] for r in rows] == ["1", "3"]
    assert float(rows[0]["p99_ms"]) == pytest.approx(doc["levels"][0]["latency_ms"]["p99"], 1e-3)
    assert rows[0]["server_compute_ms"] != ""


def test_repeats_windows_until_stable_or_gives_up(bench_server: ServerProcess) -> None:
    code, out = run(
        "bench",
        "digits",
        "--duration",
        "0.3",
        "--max-windows",
        "4",
        "--url",
        bench_server.url,
        "--json",
    )
    assert code == 0, out
    [lv] = json.loads(out)["levels"]
    assert isinstance(lv["stable"], bool)
    assert lv["windows"] == 3  # stable at 3, or the last 3 of 4 reported
    # Stability is judged on the last 3 windows: it stops at the 3rd when they agree,
    # at the 4th otherwise (stable then or not), never before the 3rd or after the 4th.
    assert lv["windows_measured"] in (3, 4)
    if lv["windows_measured"] == 3 or not lv["stable"]:
        assert lv["windows_measured"] == (3 if lv["stable"] else 4)


def test_inputs_from_files_and_shapes(bench_server: ServerProcess, tmp_path: Path) -> None:
    base = ["--duration", "0.3", "--windows", "1", "--url", bench_server.url, "--json"]
    sample = REPO / "examples" / "digit-7.npy"
    code, out = run("bench", "digits", "--input-data", str(sample), *base)
    assert code == 0, out
    np.savez(tmp_path / "in.npz", input=np.load(sample)[None].repeat(3, axis=0))
    code, out = run("bench", "digits", "--input-data", str(tmp_path / "in.npz"), *base)
    assert code == 0, out
    assert json.loads(out)["rows_per_request"] == 3
    request = tmp_path / "req.json"
    request.write_text(json.dumps(scripted_inputs(rows=2, sleep_ms=0)))
    code, out = run("bench", "slow", "--input-data", str(request), *base)
    assert code == 0, out
    assert json.loads(out)["levels"][0]["ok"] > 0
    code, out = run("bench", "slow", "--shape", "x:4", "--shape", "sleep_ms:1", *base)
    assert code == 0, out
    code, out = run("bench", "slow", "--shape", "x:5", *base)
    assert code == 2
    assert "does not fit the model's [-1, 4]" in json.loads(out)["error"]


def test_bad_npy_files_are_one_line_and_exit_2(bench_server: ServerProcess, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes((REPO / "examples" / "digit-7.npy").read_bytes()[:100])
    pickled = tmp_path / "pickled.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    url = ["--url", bench_server.url]
    cases = [
        (["bench", "digits", "--input-data", str(truncated)], "not a readable .npy"),
        (["infer", "digits", str(pickled)], "pickled"),
        (["bench", "digits", "--input-data", str(pickled)], "pickled"),
        (["infer", "digits", str(truncated)], "not a readable .npy"),
    ]
    # Each command meets each kind of bad file in-process; the real command (a second of
    # CPU a process) once each, one file apiece, for what only a process shows: its stderr.
    for args, words in cases:
        result = runner.invoke(app, [*args, *url])
        assert result.exit_code == 2, result.output
        assert words in result.stderr
        assert "Traceback" not in result.output
    for args, words in cases[:2]:
        done = subprocess.run(
            [sys.executable, "-m", "infergate", *args, *url],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert words in done.stderr
        assert "Traceback" not in done.stderr


def test_refused_sends_are_failures(bench_server: ServerProcess, tmp_path: Path) -> None:
    request = tmp_path / "req.json"
    request.write_text(json.dumps(scripted_inputs(rows=1, sleep_ms=200)))
    code, out = run(
        "bench",
        "slow",
        "--input-data",
        str(request),
        "--request-rate-range",
        "20",
        "--max-connections",
        "1",
        "--duration",
        "1",
        "--windows",
        "1",
        "--url",
        bench_server.url,
        "--json",
    )
    assert code == 1, out
    assert "levels" in json.loads(out), out
    [lv] = json.loads(out)["levels"]
    kinds = {f["kind"]: f for f in lv["failures"]}
    assert kinds["not_sent"]["status"] is None
    assert "connections were waiting" in kinds["not_sent"]["error"]
    assert lv["latency_ms"]["p50"] >= 200  # no 0 ms latencies from refused sends


@pytest.mark.serial  # a p50 ceiling against a wall clock: run alone
async def test_open_loop_latency_counts_from_when_a_request_was_due(
    bench_server: ServerProcess,
) -> None:
    """The generator stalls for 0.3 s (as a busy client machine would); requests due then
    go out late, and their latency includes the wait. The server answers in a few ms."""
    meta = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]}
    body, headers = prepare(sample_inputs(meta, 1), binary=True)
    target = Target(bench_server.url, "/v2/models/digits/infer", body, headers)
    stalled: list[float] = []

    def stall(_: Progress) -> None:
        if not stalled:
            stalled.append(time.perf_counter())
            time.sleep(0.3)  # blocks the generator's event loop: the stall under test

    result = await run_level(target, "rate", 100, Plan(window_s=1.0, windows=1), stall)
    assert stalled
    assert result.failed == 0
    assert result.latency_ms is not None
    assert result.latency_ms.max >= 250
    assert result.latency_ms.p50 < 250


def test_progress_line_on_stderr(bench_server: ServerProcess) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "infergate",
            "bench",
            "digits",
            "--concurrency-range",
            "2",
            "--duration",
            "0.3",  # the line is written every 0.25 s
            "--windows",
            "1",
            "--progress",
            "--url",
            bench_server.url,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    line = done.stderr.splitlines()[0]
    assert line.startswith("concurrency 2: ")
    assert "req/s ok" in line
    assert "0 errors" in line


def test_range_parsing_errors_are_usage_errors(bench_server: ServerProcess) -> None:
    for bad in ("many", "4:1", "1:4:0", "1.5"):
        code, _ = run("bench", "digits", "--concurrency-range", bad, "--url", bench_server.url)
        assert code == 2, bad


def test_a_hung_model_is_a_failure_not_an_idle_run(
    bench_server: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run (in this process) waits this long for the request still out: 5 s by default,
    # all of it idle here, where the request never comes back.
    monkeypatch.setattr(loadgen, "DRAIN_S", 0.5)
    request = tmp_path / "req.json"
    request.write_text(json.dumps(scripted_inputs(rows=1, hold=7)))  # never released here
    started = time.monotonic()
    try:
        code, out = run(
            "bench", "held", "--input-data", str(request), "--concurrency-range", "1",
            "--duration", "0.3", "--windows", "1", "--url", bench_server.url, "--json",
        )  # fmt: skip
    finally:
        gates = bench_server.models.parent / "gates"
        gates.mkdir(exist_ok=True)
        (gates / "release-7").touch()
    assert time.monotonic() - started < 30  # ended, though no request ever came back
    assert code == 1, out
    assert "levels" in json.loads(out), out
    [lv] = json.loads(out)["levels"]
    assert (lv["ok"], lv["latency_ms"]) == (0, None)
    [lost] = lv["failures"]
    assert (lost["kind"], lost["status"], lost["count"]) == ("no_answer", None, 1)
    assert "no answer by the end of the run" in lost["error"]
