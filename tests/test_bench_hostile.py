"""`infergate bench` against hostile or broken servers and absurd flags: non-finite or
endless level ranges, unknown inputs and unwritable files are usage errors before
anything runs (exit 2); answers that are not HTTP, or cannot be read, count as failures,
never as successes and never as tracebacks; an error page is one line in the failures;
a level that measured nothing exits 1. README's contract ("`infergate bench`")."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import typer

from infergate import loadgen
from infergate.cli.bench_args import parse_range
from infergate.loadgen import Plan, Target, run_level
from tests.fake_servers import HTML_500, FakeServer, Route, one_error_line, run


def test_bench_absurd_flags_are_usage_errors(model_server: FakeServer, tmp_path: Path) -> None:
    for text in ("nan", "inf", "1,inf", "1:inf", "nan:4"):
        with pytest.raises(typer.BadParameter):
            parse_range(text, "--request-rate-range", integer=False)  # inf once hung the run
    with pytest.raises(typer.BadParameter, match="makes 9999999990001 levels; at most 1000"):
        parse_range("1:1e9:0.0001", "--request-rate-range", integer=False)
    bad = [
        ["--concurrency", "nan"],
        ["--concurrency", "inf"],
        ["--duration", "nan"],
        ["--duration", "inf"],
        ["--stability-percentage", "-5"],
        ["--stability-percentage", "nan"],
        ["--shape", "nosuch:4"],
        ["-f", str(tmp_path / "missing" / "out.csv")],
        ["-f", str(tmp_path)],
        ["--model-version", ".."],
    ]
    for flags in bad:
        r = run("bench", "m", "--duration", "0.2", "--windows", "1", *flags, "--url",
                model_server.url)  # fmt: skip
        assert r.code == 2, (flags, r)
        one_error_line(r)
    assert "POST /v2/models/m/infer" not in model_server.requests  # nothing run for nothing


def test_bench_a_level_that_measured_nothing_exits_1(model_server: FakeServer) -> None:
    r = run("bench", "m", "--duration", "1e-9", "--windows", "1", "--json", "--url",
            model_server.url)  # fmt: skip
    assert r.code == 1, r
    [level] = json.loads(r.stdout)["levels"]
    assert (level["requests"], level["failed"]) == (0, 0)
    assert r.stderr.startswith("error: concurrency 1: no request was answered or due")


async def test_bench_counts_unreadable_answers_as_failures_without_tracebacks(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not HTTP, a Content-Length that is not a number, a chunked or close-delimited body:
    each is a failure, never a success, and no "Fatal error on transport" traceback."""
    monkeypatch.setattr(loadgen, "DRAIN_S", 0.5)
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    cases = [
        (Route(mode="raw", raw=b"garbage\r\n\r\n"), "unreadable answer: ValueError"),
        (Route(mode="raw", raw=b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n"),
         "unreadable answer: ValueError"),
        (Route(mode="chunked"), "without a Content-Length"),
        (Route(mode="raw", raw=b"HTTP/1.0 200 OK\r\n\r\n{}"), "without a Content-Length"),
    ]  # fmt: skip
    try:
        for route, words in cases:
            fake.routes["*"] = route
            target = Target(fake.url, "/v2/models/m/infer", b"{}", {})
            result = await run_level(target, "concurrency", 1, Plan(window_s=0.2, windows=1))
            assert result.ok == 0, (route, result)
            assert result.failed > 0
            [failure] = result.failures
            assert failure.kind == "no_answer"
            assert words in failure.error, failure.error
        assert reported == []
    finally:
        loop.set_exception_handler(None)


def test_bench_error_pages_are_one_line_in_the_failures(model_server: FakeServer) -> None:
    model_server.routes["/v2/models/m/infer"] = Route(503, HTML_500, {"Content-Type": "text/html"})
    r = run("bench", "m", "--duration", "0.2", "--windows", "1", "--json", "--url",
            model_server.url)  # fmt: skip
    assert r.code == 1
    [failure] = json.loads(r.stdout)["levels"][0]["failures"]
    assert (failure["status"], failure["error"]) == (503, "an HTML page: 500 Internal Server Error")
