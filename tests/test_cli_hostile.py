"""The CLI and the dashboard against hostile or broken servers and inputs: a server that
answers HTML, JSON of another shape, an error page, a redirect, half an answer or nothing;
odd addresses, tokens, files and flags. Each mistake is one line and an exit code (1: the
server or a check, 2: usage), never a traceback, a hang or a crash of the dashboard.

The servers here are fakes in this process (a thread, a loopback port), each answering what
its test sets; README's contract ("CLI", "`infergate bench`", "The dashboard") is what is
checked."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import typer
from textual.widgets import DataTable, Static

from infergate import loadgen
from infergate.cli.bench import parse_range
from infergate.cli.main import main
from infergate.client import Client, ClientError, normalize_url
from infergate.loadgen import Plan, Target, run_level
from infergate.tui.app import Dashboard
from infergate.tui.source import FixedSource, HttpSource
from infergate.tui.tenants import TenantScreen
from tests.polling import eventually

ENV_CLEAN = {"INFERGATE_URL": "", "INFERGATE_TOKEN": "", "INFERGATE_ADMIN_TOKEN": ""}
METADATA = {
    "name": "m",
    "versions": ["1"],
    "platform": "onnxruntime_onnx",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
}
ANSWER = {
    "model_name": "m",
    "model_version": "1",
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}],
}
HTML_500 = (
    b"<html>\r\n<head><title>500 Internal Server Error</title></head>\r\n<body>\r\n"
    b"<center><h1>500 Internal Server Error</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    # answer | hang (until the server closes) | cut (half the body, then close) |
    # raw (these bytes, then close) | chunked (a chunked 200)
    mode: str = "answer"
    raw: bytes = b""


class FakeServer:
    """HTTP/1.1 on a loopback port, in threads: each path answers its Route ("*": any
    other path); every request is recorded as "METHOD /path"."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.requests: list[str] = []
        self._release = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._httpd.handle_error = lambda *_: None  # type: ignore[method-assign]
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.01,), daemon=True)
        self._thread.start()

    def json(self, path: str, doc: Any, status: int = 200) -> None:
        self.routes[path] = Route(status, json.dumps(doc).encode())

    def close(self) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                fake.requests.append(f"{self.command} {self.path}")
                path = self.path.split("?")[0]
                route = fake.routes.get(path) or fake.routes.get("*") or Route(404, b"{}")
                if route.mode == "hang":
                    fake._release.wait()
                    self.close_connection = True
                    return
                if route.mode == "raw":
                    self.wfile.write(route.raw)
                    self.close_connection = True
                    return
                self.send_response(route.status)
                for k, v in route.headers.items():
                    self.send_header(k, v)
                if route.mode == "chunked":
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"5\r\nhello\r\n0\r\n\r\n")
                    return
                if route.mode == "cut":  # says the whole length, sends half, closes
                    self.send_header("Content-Length", str(len(route.body)))
                    self.end_headers()
                    self.wfile.write(route.body[: len(route.body) // 2])
                    self.close_connection = True
                    return
                self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                self.wfile.write(route.body)

            do_GET = do_POST = do_PATCH = do_DELETE = _any

        return Handler


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str


def run(*args: str, env: dict[str, str] | None = None) -> Run:
    """The real entry point (infergate.cli.main.main) in this process, as `infergate ARGS`
    runs it: its exit code and what it wrote (a usage mistake as it says it, in one line).
    An exception it lets out is a traceback the user would have seen: it fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {**ENV_CLEAN, **(env or {})}),
        mock.patch.object(sys, "argv", ["infergate", *args]),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as done,
    ):
        main()
    code = done.value.code
    return Run(code if isinstance(code, int) else 1, out.getvalue(), err.getvalue())


def one_error_line(r: Run) -> str:
    """The one line on stderr (and nothing on stdout) of a command that failed, which is
    not the entry point's last resort for errors no command expected."""
    assert r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), r.stderr
    assert not lines[0].startswith("error: unexpected "), lines[0]
    return lines[0]


ADMIN_COMMANDS = [
    ["model", "list"],
    ["model", "status", "m"],
    ["model", "load", "m"],
    ["tenant", "list"],
    ["tenant", "add", "t"],
    ["tenant", "set", "t", "rps=1"],
    ["breaker", "list"],
    ["breaker", "set", "m", "failure_rate=0.5"],
]


def test_an_answer_that_is_not_json_is_one_line(fake: FakeServer) -> None:
    fake.routes["*"] = Route(200, b"<html><title>Welcome to nginx!</title></html>", {})
    for command in ADMIN_COMMANDS:
        line = one_error_line(run(*command, "--url", fake.url))
        assert "with a body that is not JSON" in line, line
        assert "is it an infergate server" in line
        r = run(*command, "--url", fake.url, "--json")
        assert r.code == 1
        assert "not JSON" in json.loads(r.stdout)["error"]
    fake.routes["*"] = Route(200, b'[{"name": "\xff\xfe"}]')  # not UTF-8
    assert "not JSON" in one_error_line(run("model", "list", "--url", fake.url))
    fake.routes["*"] = Route(204, b"")
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert "with an empty body." in line
    assert line.endswith("(HTTP 204)")


@pytest.mark.parametrize(
    "body",
    ["[]", "{}", "[1]", "[{}]", "null", '"text"', '{"tenants": [{}]}', '[{"name": "m"}]'],
)
def test_json_of_another_shape_is_one_line_and_exit_1(fake: FakeServer, body: str) -> None:
    fake.routes["*"] = Route(200, body.encode())
    for command in ADMIN_COMMANDS:
        r = run(*command, "--url", fake.url)
        if r.code == 0:  # an empty list is a list; `{}` from a load or a PATCH is an answer
            continue
        line = one_error_line(r)
        assert r.code == 1, (command, r)
        assert "infergate server (of this version)" in line, line
    if body not in ("[]", "[{}]", '[{"name": "m"}]'):  # not an array: not `model list`'s shape
        r = run("model", "list", "--url", fake.url, "--json")
        assert r.code == 1, r
        assert "where infergate sends" in json.loads(r.stdout)["error"]


def test_error_pages_and_odd_error_bodies_are_one_line(fake: FakeServer) -> None:
    cases: list[tuple[Route, str]] = [
        (Route(500, HTML_500, {"Content-Type": "text/html"}), "an HTML page: 500 Internal"),
        (Route(400, json.dumps({"error": "one\ntwo\nthree"}).encode()), "one two three"),
        (Route(400, b"[1, 2]"), "[1,2] (HTTP 400)"),
        (Route(400, b'"just words"'), "just words (HTTP 400)"),
        (Route(400, b'{"error": null, "detail": "x"}'), '{"error":null,"detail":"x"}'),
        (Route(409, b'{"error": {"code": 5}}'), '{"code":5} (HTTP 409)'),
        (Route(502, b"x" * 5000 + b"\n" * 50, {}), "… (HTTP 502)"),
    ]
    for route, words in cases:
        fake.routes["*"] = route
        for command in (["model", "list"], ["tenant", "remove", "t"]):
            line = one_error_line(run(*command, "--url", fake.url))
            assert words in line, line
            assert len(line) < 400, line


def test_a_redirect_is_said_not_followed_nor_read_as_data(fake: FakeServer) -> None:
    fake.routes["*"] = Route(302, b"", {"Location": "https://login.example/sso"})
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert "with a redirect to https://login.example/sso" in line
    assert line.endswith("(HTTP 302)")
    assert fake.requests == ["GET /admin/models"]  # not followed


def test_half_an_answer_and_no_answer_are_said_as_such(fake: FakeServer) -> None:
    fake.routes["*"] = Route(200, json.dumps([{"name": "m"}] * 50).encode(), mode="cut")
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert f"{fake.url} broke off its answer to GET /admin/models" in line
    assert ".." not in line
    fake.routes["*"] = Route(mode="hang")
    with Client(fake.url, timeout_s=0.2) as c, pytest.raises(ClientError) as caught:
        c.models()
    assert caught.value.message == (
        f"{fake.url} did not answer GET /admin/models within 0.2 s (ReadTimeout)"
    )


def test_an_https_url_to_a_plain_server_says_tls(fake: FakeServer) -> None:
    line = one_error_line(run("model", "list", "--url", fake.url.replace("http:", "https:")))
    assert "the TLS handshake failed" in line
    assert "use http://" in line


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:abc", "the port is not a number"),
        ("127.0.0.1:99999", "the port is not a number"),
        ("::::", "no host in it"),
        ("http://", "no host in it"),
        ("ftp://127.0.0.1:21", "not an http:// or https:// address"),
        ("http://gw example", "an address holds no spaces"),
        ("http://gw:8000/?a=1", "no ?query or #fragment"),
    ],
)
def test_an_address_that_is_not_one_is_a_usage_error(url: str, words: str) -> None:
    for command in (["model", "list"], ["infer", "m", "x=[[1, 2]]"], ["bench", "m"]):
        r = run(*command, "--url", url)
        assert r.code == 2, (command, r)
        assert words in one_error_line(r)
    r = run("tenant", "list", env={"INFERGATE_URL": url})
    assert r.code == 2
    assert one_error_line(r).startswith(f"error: INFERGATE_URL {url!r}: ")
    r = run("top", "--url", url)
    assert (r.code, words in one_error_line(r)) == (2, True)


def test_a_token_no_header_can_carry_is_a_usage_error(fake: FakeServer) -> None:
    for token in ("clé", "a\nb"):
        r = run("model", "list", "--url", fake.url, env={"INFERGATE_ADMIN_TOKEN": token})
        assert r.code == 2
        assert "the token holds characters an HTTP header cannot carry" in one_error_line(r)
        r = run("infer", "m", "x=[[1, 2]]", "--url", fake.url, "--token", token)
        assert r.code == 2
    assert fake.requests == []


def test_dot_names_stay_out_of_the_path(fake: FakeServer) -> None:
    """`.` and `..` are path steps: `model unload .` was POST /v2/repository/models/unload
    (a model named "unload"), and a version `../../echo` reached model echo."""
    for command in (
        ["model", "unload", "."],
        ["model", "status", ".."],
        ["breaker", "reset", ".."],
        ["tenant", "remove", "."],
        ["infer", "..", "x=[[1, 2]]"],
    ):
        r = run(*command, "--url", fake.url)
        assert r.code == 2, (command, r)
        assert "not a name (empty, . or ..)" in one_error_line(r)
    assert fake.requests == []
    fake.json("*", {"error": "no such version"}, 404)
    run("infer", "m", "x=[[1, 2]]", "--model-version", "1/../../echo", "--url", fake.url)
    assert fake.requests == ["GET /v2/models/m/versions/1%2F..%2F..%2Fecho"]


@pytest.fixture
def model_server(fake: FakeServer) -> FakeServer:
    """Model `m` (x: FP32 [-1, 2] in, y out), answering ANSWER."""
    fake.json("/v2/models/m", METADATA)
    fake.json("/v2/models/m/infer", ANSWER)
    return fake


def test_infer_odd_input_files_are_usage_errors(model_server: FakeServer, tmp_path: Path) -> None:
    np.save(tmp_path / "complex.npy", np.array([[1 + 2j, 3j]]))
    np.save(tmp_path / "when.npy", np.array(["2020-01-01"], dtype="datetime64[D]"))
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "dir.npy").mkdir()
    (tmp_path / "ragged.json").write_text("[[1, 2], [3]]")
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    os.mkfifo(tmp_path / "fifo.npy")
    cases = [
        ("complex.npy", "complex128 has no KServe V2 datatype"),
        ("when.npy", "datetime64[D] has no KServe V2 datatype"),
        ("dir.json", "dir.json: not a regular file"),
        ("dir.npy", "dir.npy: not a regular file"),
        ("fifo.npy", "fifo.npy: not a regular file"),  # not opened: it would wait for a writer
        ("missing.json", "missing.json: no such file"),
        ("ragged.json", "ragged (rows of different lengths)"),
        ("deep.json", "deep.json: not JSON (depth limit exceeded"),
    ]
    for name, words in cases:
        r = run("infer", "m", f"x={tmp_path / name}", "--url", model_server.url)
        assert r.code == 2, (name, r)
        assert words in one_error_line(r), name
    for literal in ("[[null, 1]]", '{"a": 1}', "[[1e999, 1]]"):
        r = run("infer", "m", f"x={literal}", "--url", model_server.url)
        assert r.code == 2, (literal, r)
        one_error_line(r)
    r = run("infer", "m", "x=[[1, 2]]", "x=[[3, 4]]", "--url", model_server.url)
    assert r.code == 2
    assert "input 'x' is given twice" in one_error_line(r)
    assert "POST /v2/models/m/infer" not in model_server.requests  # none was sent


@pytest.mark.parametrize(
    ("answer", "header_length", "words"),
    [
        (b"hello", None, "unexpected character"),
        (b"[1]", None, "the JSON is an array, not an object"),
        (b'{"outputs": null, "model_name": "m"}', None, ""),  # no outputs: a table of none
        (b'{"outputs": [{"name": "y", "datatype": "FP32"}]}', None, "KeyError: 'shape'"),
        (b'{"outputs": [{"name": 5, "datatype": "FP32", "shape": [1], "data": [1]}]}', None,
         "name and datatype are not strings"),
        (b'{"outputs": [{"name": "y", "datatype": "FP99", "shape": [1], "data": [1]}]}', None,
         "unknown datatype 'FP99'"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [5], "data": [1]}]}', None,
         "cannot reshape"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": ["a"]}]}', None,
         "could not convert"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None,
         "has the shape [-1]"),
        (b'{"outputs": []}', "abc", "Inference-Header-Content-Length 'abc' does not fit"),
        (b'{"outputs": []}', "-5", "Inference-Header-Content-Length '-5' does not fit"),
        (b'{"outputs": []}', "99", "Inference-Header-Content-Length '99' does not fit"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [4], '
         b'"parameters": {"binary_data_size": 16}}]}', "json",
         "binary_data_size 16 runs past the body"),
        (b'{"model_name": 5, "model_version": {"a": 1}, "outputs": [{"name": "y", '
         b'"datatype": "FP32", "shape": [1], "data": [1]}]}', None, ""),
    ],
)  # fmt: skip
def test_infer_an_answer_that_is_not_a_v2_response_is_one_line(
    model_server: FakeServer, answer: bytes, header_length: str | None, words: str
) -> None:
    headers = {"Content-Type": "application/json"}
    if header_length is not None:  # "json": the JSON's own length (no binary data after it)
        length = str(len(answer)) if header_length == "json" else header_length
        headers["Inference-Header-Content-Length"] = length
    model_server.routes["/v2/models/m/infer"] = Route(200, answer, headers)
    for json_flag in ([], ["--json"]):
        r = run("infer", "m", "x=[[1, 2]]", "--url", model_server.url, *json_flag)
        if not words:  # readable, if odd: shown
            assert r.code == 0, r
            continue
        assert r.code == 1, r
        said = json.loads(r.stdout)["error"] if json_flag else one_error_line(r)
        assert "with something that is not a V2 inference response (" in said, said
        assert words in said, said


@pytest.mark.parametrize(
    "metadata",
    [[], {"inputs": [5]}, {"inputs": [{"name": "x"}]}, {"inputs": [{"name": "x",
     "datatype": "WAT", "shape": [1]}]}, {"inputs": [{"name": "x", "datatype": "FP32",
     "shape": None}]}, {"inputs": {"x": 1}}],
)  # fmt: skip
def test_odd_model_metadata_is_one_line(model_server: FakeServer, metadata: Any) -> None:
    model_server.json("/v2/models/m", metadata)
    for command in (["infer", "m", "x=[[1, 2]]"], ["bench", "m", "--duration", "0.1"]):
        r = run(*command, "--url", model_server.url)
        assert r.code == 1, (command, r)
        assert "answered GET /v2/models/m with" in one_error_line(r)
    assert "POST /v2/models/m/infer" not in model_server.requests


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


def test_key_new_write_to_an_odd_profile_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "folder.toml").mkdir()
    (tmp_path / "bad.toml").write_text("{not toml")
    (tmp_path / "string.toml").write_text('[server]\nadmin_keys = "sha256:abc"\n')
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe[server]")
    cases = [
        ("folder.toml", "cannot read"),
        ("bad.toml", "is not TOML"),
        ("string.toml", "server.admin_keys is not a list"),
        ("binary.toml", "is not TOML"),
        ("missing/x.toml", "cannot write"),
    ]
    for name, words in cases:
        r = run("key", "new", "--admin", "--write", "--profile", str(tmp_path / name))
        assert r.code == 2, (name, r)
        assert words in one_error_line(r)
    assert (tmp_path / "string.toml").read_text() == '[server]\nadmin_keys = "sha256:abc"\n'


def test_model_keygen_sign_verify_on_odd_paths(tmp_path: Path) -> None:
    r = run("model", "keygen", str(tmp_path / "missing" / "k"))
    assert r.code == 2
    assert "cannot write the key to" in one_error_line(r)
    (tmp_path / "old.pub").write_text("a public key someone trusts")
    r = run("model", "keygen", str(tmp_path / "old"))
    assert r.code == 2  # its .pub would have been overwritten
    assert (tmp_path / "old.pub").read_text() == "a public key someone trusts"
    assert not (tmp_path / "old").exists()
    assert run("model", "keygen", str(tmp_path / "k")).code == 0
    (tmp_path / "dir.onnx").mkdir()
    for command in (["sign", str(tmp_path / "dir.onnx"), "--key", str(tmp_path / "k")],
                    ["verify", str(tmp_path / "dir.onnx")]):  # fmt: skip
        r = run("model", *command)
        assert r.code == 2
        assert "not a regular file" in one_error_line(r)
    model = tmp_path / "model.onnx"
    model.write_bytes(b"weights")
    r = run("model", "verify", str(model), "--sha256", "abc")
    assert r.code == 1
    line = one_error_line(r)
    assert "not the 'abc' of --sha256" in line
    assert "model.toml" not in line  # no model.toml was involved


def test_settings_given_twice_or_an_empty_list_are_usage_errors(fake: FakeServer) -> None:
    for settings, words in (
        (["rps=1", "rps=2"], "rps is given twice"),
        (["models="], "models=[] says none"),
        (["models=,,"], "models=[] says none"),
    ):
        r = run("tenant", "set", "t", *settings, "--url", fake.url)
        assert r.code == 2, (settings, r)
        assert words in one_error_line(r)
    assert fake.requests == []
    fake.json("/admin/tenants/t", {"name": "t"})
    r = run("tenant", "set", "t", "rps=null", 'models=["a"]', "--url", fake.url)
    assert r.stdout == 'tenant t: rps = null (its default applies), models = ["a"]\n'


def test_an_unexpected_error_is_one_line_unless_tracebacks_are_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from infergate.cli import main as entry

    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr("infergate.cli.doctor._python", broken)
    monkeypatch.setattr("sys.argv", ["infergate", "doctor"])
    with pytest.raises(SystemExit) as done:
        entry.main()
    assert done.value.code == 1
    assert capsys.readouterr().err == (
        "error: unexpected RuntimeError: a bug over two lines. Hint: this is a bug in "
        "infergate; INFERGATE_TRACEBACKS=1 shows where, for a report\n"
    )
    monkeypatch.setenv("INFERGATE_TRACEBACKS", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        entry.main()


def test_normalize_url_keeps_what_worked() -> None:
    assert normalize_url("localhost:8000") == "http://localhost:8000"
    assert normalize_url(" https://gw.example:9000/ ") == "https://gw.example:9000"
    assert normalize_url("[::1]:8000") == "http://[::1]:8000"
    assert normalize_url("http://gw/prefix/") == "http://gw/prefix"


ODD_STATS: list[dict[str, Any]] = [
    {"models": ["a", "b"], "devices": "cpu", "workers": [1], "tenants": "t", "events": ["x"]},
    {"models": {"a": 1}, "throughput": [1, 2, 3]},
    {"models": [{"name": "a", "state": None, "breaker": 5, "versions": 7, "queue": [1],
                 "reason": 5}, {"name": "a"}, {"state": "ready"}]},
    {"devices": [{"name": "d", "memory_total_mb": "lots", "memory_used_mb": None}]},
    {"throughput": [{"rps": "fast", "p99_ms": None}, {"rps": float("inf"), "p99_ms": 1e308},
                    {"rps": 1e308, "p99_ms": float("nan")}]},
    {"events": [{"id": [1], "time": "yesterday", "kind": None},
                {"id": 2, "time": 1e20, "kind": "x"}, {"id": 3, "time": float("nan")}]},
    {"tenants": [{"name": "t"}, {"name": "t"}], "tenant_details": [1, {"name": "t",
     "rate_limited": 1.5}], "tenant_latency": {"t": [1, 2]}},
]  # fmt: skip


class CountingSource(FixedSource):
    def __init__(self, doc: dict[str, Any]) -> None:
        super().__init__(doc)
        self.fetches = 0

    async def fetch(self) -> dict[str, Any]:
        self.fetches += 1
        return self.doc


def polled(source: CountingSource, fetches: int) -> Callable[[], bool]:
    return lambda: source.fetches >= fetches


def says(status: Static, words: str) -> Callable[[], bool]:
    return lambda: words in str(status.render())


async def test_the_dashboard_survives_statistics_of_any_shape() -> None:
    source = CountingSource({})
    app = Dashboard(source, interval_s=0.05)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("t")  # the tenants view, open over the rest, reads each one too
        await eventually(lambda: isinstance(app.screen, TenantScreen))
        for doc in ODD_STATS:
            source.doc = doc
            await eventually(polled(source, source.fetches + 2), what="two polls of it")
            await pilot.pause()
            assert app.connected is True, (doc, str(app.query_one("#status", Static).render()))
        await pilot.press("escape")
        await eventually(lambda: not isinstance(app.screen, TenantScreen))
        assert [str(c) for c in app.query_one("#tenants", DataTable).get_row_at(0)][0] == "t"
    assert app.return_code in (None, 0)


async def test_the_dashboard_says_what_is_wrong_with_a_server_in_one_line(
    fake: FakeServer,
) -> None:
    cases: list[tuple[Route, str]] = [
        (Route(200, b"<html>hi</html>", {}), "not JSON at /admin/stats: not an infergate server?"),
        (Route(200, b"[1]"), "no statistics at /admin/stats: not an infergate server?"),
        (Route(200, b""), "no statistics at /admin/stats: not an infergate server?"),
        (Route(200, b"1e999"), "not JSON at /admin/stats"),
        (Route(500, HTML_500, {}), "500: an HTML page: 500 Internal Server Error; retrying"),
        (Route(400, b"[1, 2]"), "400: [1,2]; retrying"),
        (Route(400, json.dumps({"error": "a\nb"}).encode()), "400: a b; retrying"),
        (Route(302, b"", {"Location": "/x"}), "302: a redirect; give the server's own address"),
        (Route(503, b"y" * 500, {}), "503: yyy"),
    ]
    app = Dashboard(HttpSource(fake.url, None), interval_s=0.05)
    async with app.run_test(size=(80, 24)) as pilot:
        status = app.query_one("#status", Static)
        for route, words in cases:
            fake.routes["*"] = route
            await eventually(says(status, words), what=words)
            text = str(status.render())
            assert "\n" not in text
            assert len(text) <= status.content_region.width, text
            assert app.connected is False
        fake.json("/admin/stats", {"models": [{"name": "m", "state": "ready"}]})
        await eventually(lambda: app.connected is True)
        await pilot.pause()
        assert app.query_one("#models", DataTable).row_count == 1


class Unreadable(dict[str, Any]):
    """Statistics no field reader foresees: every read of a field fails."""

    def get(self, *_: Any) -> Any:
        raise RuntimeError("no reading\nthis")


async def test_the_dashboard_says_data_it_cannot_show_and_stays_up() -> None:
    app = Dashboard(FixedSource(Unreadable()), interval_s=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await eventually(lambda: app.connected is False)
        await pilot.pause()
        assert str(app.query_one("#status", Static).render()) == (
            "data the dashboard cannot show (RuntimeError: no reading this); retrying every…"
        )
    assert app.return_code in (None, 0)
