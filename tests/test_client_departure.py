"""A client that sends a request and closes its connection gets nothing run for it: its
body is not decoded, its request is not queued, or leaves the queue, and the access log
and the metrics say 499. A flood of such requests (1 MB bodies from four threads) kept one
process decoding and running them for over a minute, another tenant's request behind
them. In one process and behind a front, for the lane's small bodies and the ASGI
route's large ones (decoded in the helper process)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.errors import ClientGone
from infergate.server.departure import Departure, unless_gone
from tests.polling import wait_until
from tests.scripted_runtime import holding, make_scripted, scripted_inputs
from tests.server import ServerProcess

# --- Departure and unless_gone -------------------------------------------------------------


async def test_a_wait_ends_in_client_gone_when_its_client_leaves_cancelling_what_it_awaits() -> (
    None
):
    listened: list[bool] = []
    departure = Departure(listen=lambda: listened.append(True))
    waited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(unless_gone(departure, waited))
    await asyncio.sleep(0)
    assert listened == [True]  # the connection is read again, so that its end is seen
    departure.left()
    with pytest.raises(ClientGone):
        await waiting
    assert waited.cancelled()
    assert departure.gone


async def test_a_client_that_stays_gets_the_result_and_another_cancel_stays_a_cancel() -> None:
    departure = Departure()
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await unless_gone(departure, done) == 7

    stopping = asyncio.ensure_future(
        unless_gone(departure, asyncio.get_running_loop().create_future())
    )
    await asyncio.sleep(0)
    stopping.cancel()  # the drain's end, say: not the client's doing
    with pytest.raises(asyncio.CancelledError):
        await stopping
    departure.left()  # nothing is left watching
    assert not departure._watchers


def test_a_closing_transport_counts_as_gone_before_the_connection_is_lost() -> None:
    closing = [False]
    departure = Departure(closing=lambda: closing[0])
    assert not departure.gone
    closing[0] = True
    assert departure.gone


# --- a gateway: requests of clients that left --------------------------------------------

LARGE_PAD = 200_000  # over 64 KB: the ASGI route, and the body decoder's helper process


@pytest.fixture(params=[0, 1], ids=["one-process", "fronts"])
def held_server(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerProcess, Path]]:
    gates = tmp_path / "gates"
    gates.mkdir()
    models = tmp_path / "models"
    make_scripted(models / "held" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    profile = tmp_path / "profile.toml"
    profile.write_text(
        f"[server]\nfronts = {request.param}\n"
        # No queue deadline comes into it: what leaves the queue here left with its client.
        '[classes.patient]\nrank = 0\ndeadline_ms = 60000\n[tenants.default]\nclass = "patient"\n'
    )
    server = ServerProcess(models, profile, tmp_path / "server.log", args=("--access-log",))
    server.start()
    yield server, gates
    (gates / "release-1").touch()
    server.stop()


def _send_and_leave(server: ServerProcess, body: bytes) -> None:
    """The whole request, then the connection closed without reading a byte."""
    head = (
        f"POST /v2/models/held/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)


def _runs(server: ServerProcess) -> tuple[int, int]:
    """The model's (batches, rows) run so far, from its Triton statistics."""
    stats = httpx.get(f"{server.url}/v2/models/held/stats", timeout=10).json()
    model = stats["model_stats"][0]
    return model["execution_count"], model["inference_count"]


def _logged(server: ServerProcess, status: int) -> int:
    text = server.log.read_text(errors="replace")
    return len(re.findall(rf"POST /v2/models/held/infer {status} ", text))


def test_requests_whose_clients_left_are_never_run(
    held_server: tuple[ServerProcess, Path],
) -> None:
    server, gates = held_server
    statuses: list[int] = []

    def held() -> None:  # the one instance busy until released: the others queue
        answer = httpx.post(
            f"{server.url}/v2/models/held/infer", json=scripted_inputs(hold=1), timeout=60
        )
        statuses.append(answer.status_code)

    thread = threading.Thread(target=held)
    thread.start()
    wait_until(lambda: holding(gates, 1), 30)
    batches, rows = _runs(server)

    small = json.dumps(scripted_inputs(hold=0)).encode()  # the lane
    large = json.dumps({**scripted_inputs(hold=0), "pad": "x" * LARGE_PAD}).encode()
    for body in (small, small, small, large, large):
        _send_and_leave(server, body)
    wait_until(lambda: _logged(server, 499) == 5, 30)

    (gates / "release-1").touch()
    thread.join(30)
    assert statuses == [200]
    # A request behind the ones that left: by its answer, they would have run.
    after = httpx.post(f"{server.url}/v2/models/held/infer", json=scripted_inputs(hold=0))
    assert after.status_code == 200
    assert _runs(server) == (batches + 2, rows + 2)  # the held request's, and this one's
    assert "Traceback" not in server.log.read_text(errors="replace")
