"""`[server] fronts = N` (server/fronts.py, server/front.py): the engine behind N front
processes answers as one process does, a front that dies is started again, and fronts
do not outlive their engine. The drain through fronts is in test_edge_drain.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from infergate.loadgen import prepare
from infergate.server.drain import Drain
from tests.onnx_models import make_mlp
from tests.server import ServerProcess

PROFILE = "[server]\nmax_request_mb = 0.02\nfronts = {fronts}\n"


def _fronts_of(engine: int) -> set[int]:
    """The engine's front processes (named ig-front, server/front.py)."""
    found = set()
    for task in Path(f"/proc/{engine}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() == "ig-front":
                    found.add(int(child))
            except FileNotFoundError:
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _until(check: Any, what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return got


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fronts") / "models"
    make_mlp(folder / "mlp" / "1" / "model.onnx", sizes=(4, 8, 3))
    return folder


def _serve(models: Path, folder: Path, fronts: int) -> ServerProcess:
    profile = folder / f"profile-{fronts}.toml"
    profile.write_text(PROFILE.format(fronts=fronts))
    return ServerProcess(models, profile, folder / f"server-{fronts}.log", args=("--access-log",))


def _start_with_fronts(server: ServerProcess) -> ServerProcess:
    """`server` (with fronts) started, back once every front listens. Ready is answered by
    the first front that listens; one killed before it listens fails the gateway's start
    (FrontFailed), which no test here is about: on a busy machine the second front often
    listened first, and the front a test killed had not yet. The gateway says when all do."""
    logged = server.log.stat().st_size if server.log.exists() else 0
    server.start()
    _until(lambda: b"front processes)" in server.log.read_bytes()[logged:], "fronts listening")
    return server


@pytest.fixture(scope="module")
def pair(models: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The same models in one process and behind 2 fronts, for the whole file (a gateway
    with fronts costs a few seconds of CPU to start): the tests that kill one of split's
    fronts, or its engine, take it through `split`."""
    folder = models.parent
    one, split = _serve(models, folder, 0).start(), _start_with_fronts(_serve(models, folder, 2))
    yield one, split
    split.stop()
    one.stop()


@pytest.fixture
def split(pair: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    """pair's gateway behind 2 fronts, running with both listening: started again if a
    test before killed its engine (the last test to use it here does)."""
    server = pair[1]
    if server.process is None or server.process.poll() is not None:
        _start_with_fronts(server)
    return server


def _requests() -> list[tuple[str, str, dict[str, Any]]]:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    json_body, json_headers = prepare({"x": x}, binary=False)
    binary_body, binary_headers = prepare({"x": x}, binary=True)
    big = orjson.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}],
            "pad": "x" * 30_000,
        }
    )
    # The options a front passes on decoded (server/predecode.py), parameters as deep as
    # JSON is read; a tensor of the wrong type, decoded there and refused by the engine.
    options = orjson.dumps(
        {
            "id": "r-7",
            "parameters": {"deep": "DEEP"},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}],
            "outputs": [{"name": "y", "parameters": {"binary_data": False}}],
        }
    ).replace(b'"DEEP"', b'{"a":' * 1000 + b"1" + b"}" * 1000)
    wrong_type = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1, 4], "data": [1] * 4}]}
    )
    infer = "/v2/models/mlp/infer"
    return [
        ("POST", infer, {"content": options}),
        ("POST", infer, {"content": wrong_type}),
        ("GET", "/v2/health/live", {}),
        ("GET", "/v2/health/ready", {}),
        ("GET", "/v2/models/mlp", {}),
        ("GET", "/v2/models/mlp/ready", {}),
        ("GET", "/v2/models/nope", {}),
        ("POST", infer, {"content": json_body, "headers": json_headers}),  # the lane
        ("POST", infer, {"content": iter([json_body]), "headers": json_headers}),  # chunked
        ("POST", infer, {"content": binary_body, "headers": binary_headers}),
        ("POST", infer, {"content": b"{not json", "headers": json_headers}),  # 400
        (
            "POST",
            infer,
            {"json": {"inputs": [{"name": "nope", "datatype": "FP32", "shape": [1], "data": [1]}]}},
        ),
        ("POST", infer, {"content": big}),  # over max_request_mb: 413 (the lane)
        ("POST", infer, {"content": iter([big])}),  # and chunked
        ("POST", "/v2/models/nope/infer", {"content": json_body}),
    ]


def _answer(server: ServerProcess, method: str, path: str, kw: dict[str, Any]) -> tuple[Any, ...]:
    r = httpx.request(method, server.url + path, timeout=30, **kw)
    assert r.headers.get("x-request-id"), (path, r.status_code)
    return r.status_code, r.headers.get("content-type"), r.content


def test_fronts_answer_every_request_as_one_process_does(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    one, split = pair
    statuses = []
    # Each server its own requests: a chunked body's iterator is read once.
    for (method, path, kw), (_, _, again) in zip(_requests(), _requests(), strict=True):
        answer = _answer(split, method, path, kw)
        assert answer == _answer(one, method, path, again), path
        statuses.append(answer[0])
    assert statuses == [200, 400, 200, 200, 200, 200, 404, 200, 200, 200, 400, 400, 413, 413, 404]
    # Both paths in: the lane's line is the front's, the rest the engine's; one log.
    log = split.log.read_text()
    assert "POST /v2/models/mlp/infer 200" in log
    assert "GET /v2/models/mlp 200" in log
    assert split.process is not None
    _until(lambda: len(_fronts_of(split.process.pid)) == 2, "not 2 fronts")


def test_the_engine_counts_what_the_fronts_pass_on(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    _, split = pair
    before = httpx.get(f"{split.url}/v2/models/mlp/stats", timeout=10).json()
    body, headers = prepare({"x": np.ones((1, 4), np.float32)}, binary=False)
    for _ in range(5):
        r = httpx.post(f"{split.url}/v2/models/mlp/infer", content=body, headers=headers)
        assert r.status_code == 200
    after = httpx.get(f"{split.url}/v2/models/mlp/stats", timeout=10).json()

    def successes(doc: dict[str, Any]) -> int:
        return int(doc["model_stats"][0]["inference_stats"]["success"]["count"])

    assert successes(after) - successes(before) == 5
    metrics = httpx.get(f"{split.url}/metrics", timeout=10).text
    assert 'infergate_requests_total{model="mlp"' in metrics


def test_a_front_that_dies_is_started_again(split: ServerProcess) -> None:
    server = split
    assert server.process is not None
    engine = server.process.pid
    first = _until(lambda: _fronts_of(engine) if len(_fronts_of(engine)) == 2 else None, "2")
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    _until(lambda: len(_fronts_of(engine) - {victim}) == 2, "no front was started again")
    body, headers = prepare({"x": np.ones((1, 4), np.float32)}, binary=False)
    for _ in range(20):  # over fresh connections, spread over both fronts
        r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers=headers)
        assert r.status_code == 200
    assert f"front process {victim} exited" in server.log.read_text()


def test_a_second_gateway_cannot_share_the_port(split: ServerProcess, tmp_path: Path) -> None:
    """The fronts share the port with SO_REUSEPORT; another gateway must not join them."""
    profile = tmp_path / "profile-1.toml"  # the second one, behind a front of its own
    profile.write_text(PROFILE.format(fronts=1))
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "infergate",
            "serve",
            "--models",
            str(split.models),
            "--profile",
            str(profile),
            "--port",
            str(split.port),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert f"cannot listen on 127.0.0.1:{split.port}" in second.stderr


def test_the_fronts_go_when_their_engine_is_killed(split: ServerProcess) -> None:
    """The last test of the file to use `split`: nothing starts it again after."""
    server = split
    assert server.process is not None
    try:
        engine = server.process.pid
        fronts = _until(lambda: _fronts_of(engine) if len(_fronts_of(engine)) == 2 else None, "2")
        server.process.kill()  # SIGKILL: no drain, no word to the fronts
        server.process.wait()
        _until(lambda: not any(_alive(p) for p in fronts), "a front outlived its engine")
        with pytest.raises(httpx.TransportError):  # nobody listens on the port any more
            httpx.get(f"{server.url}/v2/health/live", timeout=5)
    finally:
        os.killpg(server.process.pid, signal.SIGKILL)  # its workers, if any are left


class _FakeEngine:
    """The front's link to the engine, recorded; the test plays the engine's answers."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self.stream: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    def open_stream(self) -> tuple[int, asyncio.Queue[tuple[Any, ...]]]:
        return 7, self.stream

    def close_stream(self, rid: int) -> None:
        pass

    def send(self, message: tuple[Any, ...], size: int = 0) -> None:
        self.sent.append(message)

    async def drained(self) -> None:
        pass


def _scope(path: str = "/admin/events") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "http_version": "1.1",
    }


async def _ignore(message: Any) -> None:
    pass


def test_a_client_that_leaves_a_stream_ends_it_in_the_engine() -> None:
    """After its body, the front still watches the client: an event stream whose client
    left is cancelled in the engine, and the front lets go of it."""
    from infergate.server.front import ForwardApp

    async def scenario() -> list[tuple[Any, ...]]:
        engine = _FakeEngine()
        left = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if not left.is_set():
                left.set()
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.disconnect"}

        app = ForwardApp(engine, Drain(), 1000)  # type: ignore[arg-type]  # a fake link
        await engine.stream.put(("want", 7))  # the stream listens for the client leaving
        await engine.stream.put(("start", 7, 200, []))
        await engine.stream.put(("chunk", 7, b"event 1\n", True))
        await asyncio.wait_for(app(_scope(), receive, _ignore), 5)
        return engine.sent

    sent = asyncio.run(scenario())
    assert [m[0] for m in sent] == ["http", "body", "cancel", "cancel"]


def test_a_request_refused_at_its_head_sends_no_body() -> None:
    """The front reads the body (and passes it on) only once the engine's app asks for it:
    a request the engine refuses at its head (401) costs no upload, and uvicorn sends no
    `100 Continue` (it does at the first read), as in one process."""
    from infergate.server.front import ForwardApp

    async def scenario() -> tuple[int, list[tuple[Any, ...]]]:
        engine = _FakeEngine()
        reads = 0

        async def receive() -> dict[str, Any]:
            nonlocal reads
            reads += 1
            if reads > 1:
                await asyncio.Future()  # the client waits for its answer
            return {"type": "http.request", "body": b"x" * 100, "more_body": False}

        app = ForwardApp(engine, Drain(), 1000)  # type: ignore[arg-type]  # a fake link
        task = asyncio.ensure_future(app(_scope("/v2/models/m/infer"), receive, _ignore))
        for _ in range(50):  # the time the engine takes to answer
            await asyncio.sleep(0)
        await engine.stream.put(("start", 7, 401, []))  # no ("want", 7) first
        await engine.stream.put(("chunk", 7, b"{}", False))
        await asyncio.wait_for(task, 5)
        return reads, engine.sent

    reads, sent = asyncio.run(scenario())
    assert reads == 0
    assert [m[0] for m in sent] == ["http"]


def test_a_body_over_the_limit_is_not_all_passed_on() -> None:
    """The engine refuses more than max_request_mb (413) as it reads; the front stops
    sending there and stops reading the client, so neither holds the rest."""
    from infergate.server.front import ForwardApp

    async def scenario() -> tuple[int, list[tuple[Any, ...]]]:
        engine = _FakeEngine()
        reads = 0

        async def receive() -> dict[str, Any]:
            nonlocal reads
            reads += 1
            return {"type": "http.request", "body": b"x" * 10_000, "more_body": True}

        app = ForwardApp(engine, Drain(), 25_000)  # type: ignore[arg-type]  # a fake link
        await engine.stream.put(("want", 7))  # the engine reads the body
        task = asyncio.ensure_future(app(_scope("/v2/models/m/infer"), receive, _ignore))
        for _ in range(50):  # let the pump run as far as it would
            await asyncio.sleep(0)
        await engine.stream.put(("start", 7, 413, []))  # the engine, past its limit
        await engine.stream.put(("chunk", 7, b"too large", False))
        await asyncio.wait_for(task, 5)
        return reads, engine.sent

    reads, sent = asyncio.run(scenario())
    assert sum(len(m[2]) for m in sent if m[0] == "body") == 30_000
    assert reads == 3


def test_an_answer_that_breaks_off_closes_the_connection() -> None:
    from infergate.errors import BrokenOff
    from infergate.server.front import ForwardApp

    async def scenario() -> None:
        engine = _FakeEngine()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        app = ForwardApp(engine, Drain(), 1000)  # type: ignore[arg-type]  # a fake link
        await engine.stream.put(("start", 7, 200, []))
        await engine.stream.put(("chunk", 7, b"half", True))
        await engine.stream.put(("abort", 7))
        await app(_scope("/v2/models/m"), receive, _ignore)

    with pytest.raises(BrokenOff):
        asyncio.run(scenario())


def test_an_answer_its_client_does_not_read_breaks_off_at_a_bounded_backlog() -> None:
    """An event stream whose client never reads: the front holds at most STREAM_BACKLOG of
    its pieces (as one process's event bus keeps a slow reader's last 1,000), then asks
    the engine to stop and the answer breaks off (the connection closes)."""
    from infergate.server.front import STREAM_BACKLOG, EngineLink

    class Link:
        def __init__(self) -> None:
            self.sent: list[tuple[Any, ...]] = []

        def send(self, message: tuple[Any, ...], size: int = 0) -> None:
            self.sent.append(message)

    async def scenario() -> tuple[int, tuple[Any, ...], list[tuple[Any, ...]]]:
        engine = EngineLink()
        link = Link()
        engine.link = link  # type: ignore[assignment]  # what the front sends, recorded
        rid, stream = engine.open_stream()
        engine._on_message(("start", rid, 200, []))
        for n in range(3 * STREAM_BACKLOG):  # the engine goes on sending events
            engine._on_message(("chunk", rid, b"event %d\n" % n, True))
        items = [stream.get_nowait() for _ in range(stream.qsize())]
        return len(items), items[-1], link.sent

    held, last, sent = asyncio.run(scenario())
    assert held == STREAM_BACKLOG + 1  # the pieces, then the break
    assert last[0] == "abort"
    assert [m[0] for m in sent] == ["cancel"]  # once, and nothing held after it
