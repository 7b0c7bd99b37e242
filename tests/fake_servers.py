"""The harness of the hostile-server tests: fake HTTP servers in this process (a thread,
a loopback port) that answer each path with whatever its test sets (HTML, JSON of another
shape, an error page, a redirect, half an answer, nothing, bytes that are not HTTP), and
the CLI's real entry point run in this process against them, read as its user sees it:
the exit code and the one line it says."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import pytest

from infergate.cli.main import main

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

    def serve_model(self) -> FakeServer:
        """Model `m` (x: FP32 [-1, 2] in, y out), answering ANSWER."""
        self.json("/v2/models/m", METADATA)
        self.json("/v2/models/m/infer", ANSWER)
        return self

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

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


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
