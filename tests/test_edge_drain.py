"""SIGTERM drains (issue 12): requests in flight finish, new ones get 503 JSON with
Retry-After while they do, then the process exits; one still running when the drain time
is up gets 503 JSON too, never a text/plain 500. Each runs in one process and with a front
process (`[server] fronts`, server/fronts.py): one, so that a request on one connection is
known to have reached it once another connection's is answered."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.edge_raw import connect, read_reply
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


def _start(tmp_path: Path, drain_timeout_s: float, fronts: int) -> tuple[ServerProcess, Path]:
    gates = tmp_path / "gates"
    gates.mkdir()
    models = tmp_path / "models"
    make_scripted(models / "held" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    profile = tmp_path / "profile.toml"
    profile.write_text(f"[server]\ndrain_timeout_s = {drain_timeout_s}\nfronts = {fronts}\n")
    return ServerProcess(models, profile, tmp_path / "server.log").start(), gates


FRONTS = pytest.mark.parametrize("fronts", [0, 1], ids=["one-process", "fronts"])


@pytest.fixture(params=[0, 1], ids=["one-process", "fronts"])
def held_server(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerProcess, Path]]:
    server, gates = _start(tmp_path, 60, request.param)
    yield server, gates
    (gates / "release-1").touch()
    server.stop()


def _hold(
    server: ServerProcess, padded: bool = False
) -> tuple[threading.Thread, list[httpx.Response]]:
    """A request that the model holds until the test releases gate 1 (`padded`: its body
    past the infer lane's 64 KiB, so that a front passes it on to the engine's app)."""
    answers: list[httpx.Response] = []
    body = {**scripted_inputs(hold=1), **({"pad": "x" * 70_000} if padded else {})}

    def send() -> None:
        answers.append(httpx.post(f"{server.url}/v2/models/held/infer", json=body, timeout=120))

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 30
    while server.model("held")["versions"][0]["in_flight"] < 1:
        assert time.monotonic() < deadline, "the held request never reached the model"
        time.sleep(0.02)
    return thread, answers


def _first_refusal(server: ServerProcess) -> httpx.Response:
    """Poll until a new request is refused (the signal is handled asynchronously)."""
    deadline = time.monotonic() + 15
    while True:
        # A request the model answers at once (hold 0): with fronts, the front's drain
        # begins a moment after the engine's, and it is served until then.
        r = httpx.post(
            f"{server.url}/v2/models/held/infer", json=scripted_inputs(hold=0), timeout=10
        )
        # 504: it arrived before the drain began (with fronts, the engine takes a moment
        # longer to hear of the signal) and waited behind the held one: not a refusal.
        if r.status_code not in (200, 504):
            return r
        assert time.monotonic() < deadline, "new requests were still served"
        time.sleep(0.02)


def test_sigterm_lets_the_request_in_flight_finish_and_refuses_new_ones(
    held_server: tuple[ServerProcess, Path],
) -> None:
    server, gates = held_server
    assert server.process is not None
    thread, answers = _hold(server)
    server.process.send_signal(signal.SIGTERM)
    refused = _first_refusal(server)
    assert refused.status_code == 503
    assert refused.headers["content-type"] == "application/json"
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["x-request-id"]
    assert "shutting down" in refused.json()["error"]
    assert not answers  # the held request is still running
    assert server.process.poll() is None  # and the gateway waits for it
    (gates / "release-1").touch()
    thread.join(60)
    assert [a.status_code for a in answers] == [200]
    assert server.process.wait(timeout=60) is not None


def test_ctrl_c_in_a_terminal_drains_too(held_server: tuple[ServerProcess, Path]) -> None:
    """A terminal's Ctrl-C signals the whole process group: the gateway drains once, as
    for one SIGTERM (with fronts, too: they are not in its group, and drain when told)."""
    server, gates = held_server
    assert server.process is not None
    thread, answers = _hold(server)
    os.killpg(server.process.pid, signal.SIGINT)
    assert _first_refusal(server).status_code == 503
    (gates / "release-1").touch()
    thread.join(60)
    assert [a.status_code for a in answers] == [200]
    assert server.process.wait(timeout=60) is not None


def test_a_request_whose_body_is_still_arriving_is_waited_for(
    held_server: tuple[ServerProcess, Path],
) -> None:
    """Counted from its head, as the drain counts every request: the signal lands while
    half its body is sent, and the rest still gets an answer."""
    server, _ = held_server
    assert server.process is not None
    body = orjson.dumps(scripted_inputs(hold=0))
    head = (
        f"POST /v2/models/held/infer HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with connect(server.port) as sock:
        sock.sendall(head + body[:10])
        # On loopback its bytes are in the gateway's socket before this next request is
        # sent, so once that one is answered the gateway has seen the head.
        assert httpx.get(f"{server.url}/v2/health/live", timeout=10).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        refused = _first_refusal(server)
        assert refused.status_code == 503
        other = httpx.get(f"{server.url}/v2/models/held", timeout=10)  # the app, not the lane
        assert other.status_code == 503
        assert other.headers["x-request-id"]  # as every answer has, a drain's too
        sock.sendall(body[10:])
        reply = read_reply(sock)
    assert reply is not None
    assert reply.status == 200
    assert server.process.wait(timeout=60) is not None


@FRONTS
@pytest.mark.parametrize("padded", [False, True], ids=["lane", "passed-on"])
def test_a_request_past_the_drain_time_gets_a_503_json(
    tmp_path: Path, fronts: int, padded: bool
) -> None:
    # A drain time of half a second: the held request is in flight before the signal,
    # and held for good, so it outlasts any drain time; 1 s waited half a second longer.
    server, gates = _start(tmp_path, 0.5, fronts)
    try:
        assert server.process is not None
        thread, answers = _hold(server, padded)
        server.process.send_signal(signal.SIGTERM)
        thread.join(60)
        assert len(answers) == 1
        assert answers[0].status_code == 503
        assert answers[0].headers["content-type"] == "application/json"
        assert "could not finish this request in time" in answers[0].json()["error"]
        # The call is still held in the worker, and no request awaits it any more: the
        # engine's stop cuts it short (0.5 s), not the 5 s a call a request awaits gets.
        # (With fronts, what the engine's app still runs for a request a front passed on
        # is cancelled once the fronts have gone, as uvicorn cancels it in one process.)
        assert server.process.wait(timeout=60) is not None
        assert "killed at stop: it did not stop within 0.5 s" in server.log.read_text()
    finally:
        (gates / "release-1").touch()
        server.stop()
