"""Tenant B (careless or hostile) against tenant A on one real server: what B sends
must not fail, refuse or starve A's requests. B's backlog does not fill A's share of a
queue; B's failing, crashing, slow or memory-hungry request does not take down the A
request batched with it; B's failures cut off B alone, whether or not A's requests come
meanwhile; and B's sequences do not take every place of a model's max_sequences."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest

from infergate.engine.admission.tenants import hash_key
from tests.polling import wait_until
from tests.scrape import metric
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.sequence_models import CORRID_SUM_TOML, make_corrid_sum
from tests.server import ServerProcess

ALICE, BOB = "alice-key", "bob-key"

# Both tenants in one class whose deadline never expires what a test queues on purpose.
PROFILE = f"""
[server]
allow_anonymous = false
body_timeout_s = 1

[devices]
monitor_interval_s = 0.05
max_kills = 2

[classes.patient]
rank = 0
deadline_ms = 60000

[tenants.alice]
class = "patient"
api_keys = ["{hash_key(ALICE)}"]

[tenants.bob]
class = "patient"
api_keys = ["{hash_key(BOB)}"]
"""


# A breaker that acts on a window of two seconds (evaluated every 0.2 s), then holds.
JUDGED = """
[breaker]
window_seconds = 2
min_requests = 4
consecutive_windows = 1
failure_rate = 0.3
latency_p99_ms = 60000
backoff_initial_s = 30
backoff_max_s = 30
"""


BIG = """
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]
[[outputs]]
name = "big"
datatype = "FP32"
shape = [-1, 1048576]
"""


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gates")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gates: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("isolation")
    models = root / "models"

    def scripted(name: str, toml: str, controls: tuple[str, ...]) -> None:
        make_scripted(models / name / "1" / "model.scripted", controls, gate_dir=gates)
        (models / name / "model.toml").write_text(toml)

    # One request at a time, four waiting at most.
    scripted("narrow", "[batching]\nmax_batch_size = 0\nmax_queue_size = 4\n", ("hold",))
    # Batching on: what waits behind a held request runs as one batch when it is let go.
    scripted("failing", "", ("hold", "fail"))
    scripted("crashing", "instances = 2\n", ("hold", "crash"))
    scripted("fragile", "", ("hold", "crash"))  # one instance: no sibling to retry on
    # B's queries of death: the breaker holds a cut-off for 30 s.
    scripted("deadly", "instances = 2\n[breaker]\nbackoff_initial_s = 30\n", ("crash",))
    scripted("slowpoke", "timeout_ms = 2000\n", ("hold",))
    scripted("judged", JUDGED, ("fail",))
    scripted("lonely", JUDGED, ("fail",))
    # An answer of 4 MB a row.
    (models / "big" / "1").mkdir(parents=True)
    (models / "big" / "1" / "model.scripted").write_text(BIG)
    # A worker past 300 MB is killed; B's request asks for 400.
    scripted("hungry", "memory_mb = 300\n", ("hold", "alloc_mb"))
    scripted("greedy", "memory_mb = 300\n", ("hold", "alloc_mb"))
    make_corrid_sum(models / "seq" / "1" / "model.onnx")
    (models / "seq" / "model.toml").write_text(CORRID_SUM_TOML)  # max_sequences = 2
    profile = root / "profile.toml"
    profile.write_text(PROFILE)
    proc = ServerProcess(models, profile, root / "server.log").start()
    yield proc
    proc.stop()


def post(server: ServerProcess, model: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


class Background:
    """Requests sent from threads, their answers kept in the order they were sent."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self.answers: dict[int, httpx.Response] = {}

    def send(self, call: Callable[[], httpx.Response]) -> int:
        index = len(self._threads)

        def run() -> None:
            self.answers[index] = call()

        thread = threading.Thread(target=run)
        self._threads.append(thread)
        thread.start()
        return index

    def status(self, index: int) -> int:
        self._threads[index].join(timeout=60)
        return self.answers[index].status_code

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=60)


def queued(server: ServerProcess, model: str) -> float:
    return metric(server, "infergate_queue_depth", absent=0.0, model=model)


def holding(gates: Path, gate: int, count: int = 1) -> bool:
    return len(list(gates.glob(f"holding-{gate}-*"))) >= count


def release(gates: Path, gate: int) -> None:
    (gates / f"release-{gate}").touch()


def test_bs_backlog_does_not_fill_as_share_of_the_queue(server: ServerProcess, gates: Path) -> None:
    """B fills the queue (max_queue_size = 4) behind its own running request; A's one
    request still gets in: one of B's waiting requests is shed for it (503 to B), since
    B holds more of the queue than A. Before, A got 503 "queue full"."""
    sent = Background()
    holder = sent.send(lambda: post(server, "narrow", BOB, scripted_inputs(hold=101)))
    wait_until(lambda: holding(gates, 101), what="B's request to run")
    release(gates, 102)  # B's backlog runs at once when its turn comes
    backlog = [
        sent.send(lambda: post(server, "narrow", BOB, scripted_inputs(hold=102))) for _ in range(4)
    ]
    wait_until(lambda: queued(server, "narrow") == 4, what="B's backlog to fill the queue")
    alice = sent.send(lambda: post(server, "narrow", ALICE, scripted_inputs(hold=102)))
    wait_until(lambda: 503 in [a.status_code for a in sent.answers.values()] or None, 10, "a shed")
    release(gates, 101)
    assert sent.status(alice) == 200, sent.answers[alice].text
    assert sent.status(holder) == 200
    bobs = sorted(sent.status(i) for i in backlog)
    assert bobs == [200, 200, 200, 503], bobs
    shed = next(sent.answers[i] for i in backlog if sent.answers[i].status_code == 503)
    assert "Retry-After" in shed.headers
    assert "more of its queue" in shed.json()["error"], shed.text


def one_batch(
    server: ServerProcess,
    gates: Path,
    model: str,
    gate: int,
    controls: dict[str, int],
    bobs: dict[str, int],
) -> tuple[Background, int, int, int]:
    """B's request held on `gate` in the model's one worker; A's request (`controls`) and
    B's (`bobs`) queued behind it, then the gate released, so that the two run as one
    batch. The requests in flight, and the holder's, A's and B's numbers among them."""
    sent = Background()
    holder = sent.send(partial(post, server, model, BOB, scripted_inputs(hold=gate, **controls)))
    wait_until(lambda: holding(gates, gate), what="the held request to run")
    alice = sent.send(partial(post, server, model, ALICE, scripted_inputs(hold=0, **controls)))
    bob = sent.send(partial(post, server, model, BOB, scripted_inputs(**bobs)))
    wait_until(lambda: queued(server, model) == 2, what="A's and B's requests to queue")
    release(gates, gate)
    return sent, holder, alice, bob


def test_bs_failing_request_does_not_fail_as_request_in_its_batch(
    server: ServerProcess, gates: Path
) -> None:
    """A's and B's requests wait behind a held one and run as one batch, where B's input
    makes the model raise: A's rows are answered, only B gets the 500."""
    sent, holder, alice, bob = one_batch(
        server, gates, "failing", 201, {"fail": 0}, {"hold": 0, "fail": 1}
    )
    assert sent.status(holder) == 200
    assert sent.status(bob) == 500
    assert sent.status(alice) == 200, sent.answers[alice].text


def test_bs_crashing_request_does_not_fail_as_request_in_its_batch(
    server: ServerProcess, gates: Path
) -> None:
    """A's and B's requests run as one batch, and B's input ends the worker process. Each
    runs again alone, on that instance once restarted (not on the sibling, which serves
    others): B's does not take A's down a second time, and A gets its answer. Before, both
    were retried as one batch again, killing the sibling too, and A got 503."""
    sent = Background()
    holders = [
        sent.send(partial(post, server, "crashing", BOB, scripted_inputs(hold=gate, crash=0)))
        for gate in (301, 302)
    ]
    wait_until(lambda: holding(gates, 301) and holding(gates, 302), what="both instances busy")
    alice = sent.send(lambda: post(server, "crashing", ALICE, scripted_inputs(hold=0, crash=0)))
    bob = sent.send(lambda: post(server, "crashing", BOB, scripted_inputs(hold=0, crash=1)))
    wait_until(lambda: queued(server, "crashing") == 2, what="A's and B's requests to queue")
    release(gates, 301)
    wait_until(lambda: bob in sent.answers or queued(server, "crashing") >= 1, what="a retry")
    release(gates, 302)
    assert [sent.status(h) for h in holders] == [200, 200]
    assert sent.status(bob) == 503
    assert sent.status(alice) == 200, sent.answers[alice].text


def sequence(server: ServerProcess, key: str, sid: int, start: bool) -> httpx.Response:
    body = {
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}],
        "parameters": {"sequence_id": sid, "sequence_start": start},
    }
    return post(server, "seq", key, body)


def test_bs_sequences_do_not_take_every_place(server: ServerProcess) -> None:
    """B starts sequences up to the model's max_sequences (2) and keeps them; A can still
    start one: B's least recently used sequence gives its place up (B is told why), since
    B holds more than its share. B alone could take every place."""
    assert sequence(server, BOB, 7, start=True).status_code == 200
    assert sequence(server, BOB, 8, start=True).status_code == 200
    assert sequence(server, BOB, 8, start=False).status_code == 200  # 7 is the older
    started = sequence(server, ALICE, 7, start=True)  # the same id: a sequence of its own
    assert started.status_code == 200, started.text
    assert sequence(server, ALICE, 7, start=False).status_code == 200
    assert sequence(server, BOB, 8, start=False).status_code == 200  # B keeps its newer one
    lost = sequence(server, BOB, 7, start=False)
    assert lost.status_code == 410, lost.text
    assert "to make room" in lost.json()["error"]
    # At its share (one of two), B cannot take A's place back.
    refused = sequence(server, BOB, 9, start=True)
    assert refused.status_code == 503, refused.text
    assert sequence(server, ALICE, 7, start=False).status_code == 200


def refused(
    server: ServerProcess, failing: str, alongside: str | None = None, model: str = "judged"
) -> Callable[[], httpx.Response | None]:
    """A function that sends a failing request of `failing`'s tenant to `model` (after a
    good one of `alongside`'s, so that the breaker's window always holds both tenants'),
    and gives the answer once the failing one gets 503."""

    def send() -> httpx.Response | None:
        if alongside is not None:
            good = post(server, model, alongside, scripted_inputs(fail=0))
            assert good.status_code == 200, good.text
        response = post(server, model, failing, scripted_inputs(fail=1))
        assert response.status_code in (500, 503), response.text
        return response if response.status_code == 503 else None

    return send


def test_bs_failures_cut_off_b_alone_not_the_model(server: ServerProcess) -> None:
    """B's inputs make the model raise (half of the window's requests, A's succeeding)
    until the breaker acts: it refuses B alone, and A is still served. Before, the
    breaker opened for every tenant, and A got 503 for its backoff (30 s here). When A's
    requests fail too, the model fails for two tenants: it opens for all."""
    cut = wait_until(refused(server, BOB, ALICE), what="the breaker to act on B's failures")
    assert "cut off for tenant 'bob'" in cut.json()["error"], cut.text
    assert "Retry-After" in cut.headers
    assert post(server, "judged", ALICE, scripted_inputs(fail=0)).status_code == 200
    assert metric(server, "infergate_breaker_state", model="judged") == 0  # closed
    [row] = [r for r in httpx.get(f"{server.url}/admin/breakers").json() if r["model"] == "judged"]
    assert set(row["tenants_cut_off"]) == {"bob"}
    shut = wait_until(refused(server, ALICE), what="the breaker to open for everyone")
    assert "cut off by its circuit breaker" in shut.json()["error"], shut.text
    assert metric(server, "infergate_breaker_state", model="judged") == 2  # open


def breaker_row(server: ServerProcess, model: str) -> dict[str, Any]:
    rows = httpx.get(f"{server.url}/admin/breakers").json()
    return next(r for r in rows if r["model"] == model)


def test_b_failing_alone_once_a_was_served_cuts_off_b_not_the_model(
    server: ServerProcess,
) -> None:
    """A is served, then goes quiet; B's inputs make the model raise while nobody else
    uses it. The breaker cannot compare B's requests with others' in the window, but the
    model has served A well: it refuses B alone, saying no other tenant's requests came,
    and A, coming back, is served. Before, it opened for everyone (30 s here)."""
    for _ in range(2):
        assert post(server, "lonely", ALICE, scripted_inputs(fail=0)).status_code == 200
    wait_until(
        lambda: breaker_row(server, "lonely")["window_requests"] == 0,
        what="A's requests to leave the breaker's window",
    )
    cut = wait_until(refused(server, BOB, model="lonely"), what="the breaker to act on B")
    error = cut.json()["error"]
    assert "cut off for tenant 'bob'" in error, error
    assert "no other tenant's requests came in the window" in error, error
    assert post(server, "lonely", ALICE, scripted_inputs(fail=0)).status_code == 200
    row = breaker_row(server, "lonely")
    assert (row["state"], set(row["tenants_cut_off"])) == ("closed", {"bob"})


def test_bs_slow_request_does_not_time_out_as_request_in_its_batch(
    server: ServerProcess, gates: Path
) -> None:
    """A's and B's requests run as one batch, which B's input holds past the model's
    timeout (2 s): the worker is killed, and each request runs again alone once it is
    restarted. A's is answered; B's, slow alone too, gets the 504. Before, both got it."""
    # 502 is never let go: B's request holds its batch, and itself alone, past the timeout.
    sent, holder, alice, bob = one_batch(server, gates, "slowpoke", 501, {}, {"hold": 502})
    assert sent.status(bob) == 504, sent.answers[bob].text
    assert sent.status(alice) == 200, sent.answers[alice].text
    sent.status(holder)  # 200, or 504 on a machine slow enough to let it time out first


def test_bs_memory_hungry_request_does_not_fail_as_request_in_its_batch(
    server: ServerProcess, gates: Path
) -> None:
    """A's and B's requests run as one batch, where B's input takes more than the
    model's memory_mb: the worker is killed, and each request runs again alone. A's is
    answered; B's, killed again alone, gets the 503. Before, neither ran again."""
    sent, holder, alice, bob = one_batch(
        server, gates, "greedy", 601, {"alloc_mb": 0}, {"hold": 602, "alloc_mb": 400}
    )
    assert sent.status(holder) == 200
    assert sent.status(bob) == 503, sent.answers[bob].text
    assert "memory limit" in sent.answers[bob].json()["error"]
    assert sent.status(alice) == 200, sent.answers[alice].text


def test_bs_crashing_request_does_not_fail_as_request_on_a_lone_instance(
    server: ServerProcess, gates: Path
) -> None:
    """As the crashing test above, on a model of one instance: with no sibling, A's and
    B's requests wait for its restart and run then, alone. A gets its answer, B (whose
    input ends the worker again) the 503. Before, both got the 503 at once."""
    sent, holder, alice, bob = one_batch(
        server, gates, "fragile", 701, {"crash": 0}, {"hold": 0, "crash": 1}
    )
    assert sent.status(holder) == 200
    assert sent.status(bob) == 503, sent.answers[bob].text
    assert sent.status(alice) == 200, sent.answers[alice].text


def test_bs_queries_of_death_cut_off_b_alone(server: ServerProcess) -> None:
    """B's requests end their worker (crash=1), each running alone. The first is not run
    again on the sibling (it would end it too: before, both workers died and A got 503
    "restarting"); the second, within the window, cuts B off for the breaker's backoff,
    though the window is far below min_requests, and A is served. Before, B went on
    ending workers and the breaker never acted."""
    assert post(server, "deadly", ALICE, scripted_inputs(crash=0)).status_code == 200
    for _ in range(2):
        server.wait_model_state("deadly", "ready")
        ended = post(server, "deadly", BOB, scripted_inputs(crash=1))
        assert ended.status_code == 503, ended.text
        assert "cut off" not in ended.json()["error"], ended.text
    server.wait_model_state("deadly", "ready")
    cut = post(server, "deadly", BOB, scripted_inputs(crash=1))
    assert cut.status_code == 503, cut.text
    error = cut.json()["error"]
    assert "cut off for tenant 'bob'" in error, error
    assert "its requests ended 2 workers of this version" in error, error
    assert "Retry-After" in cut.headers
    row = breaker_row(server, "deadly")
    assert (row["state"], set(row["tenants_cut_off"])) == ("closed", {"bob"})
    served = wait_until(
        lambda: (
            (r := post(server, "deadly", ALICE, scripted_inputs(crash=0))).status_code != 503 and r
        ),
        what="A to be served after the restarts",
    )
    assert served.status_code == 200, served.text


def test_bs_memory_hungry_requests_do_not_fail_the_model(
    server: ServerProcess, gates: Path
) -> None:
    """B's requests take more memory than the model's memory_mb, and each gets its
    worker killed: B gets 503. Kills while a request runs are that request's doing, not
    the model's own growth, so they do not count toward max_kills (2 here): before, B's
    second such request marked the model failed, and A got 424 until an operator
    reloaded it."""
    for _ in range(2):
        server.wait_model_state("hungry", "ready")
        killed = post(server, "hungry", BOB, scripted_inputs(hold=401, alloc_mb=400))
        assert killed.status_code == 503, killed.text
        assert "memory limit" in killed.json()["error"]
    served = wait_until(
        lambda: (
            (r := post(server, "hungry", ALICE, scripted_inputs(hold=0, alloc_mb=0))).status_code
            != 503
            and r
        ),
        what="the model to serve again after its restart",
    )
    assert served.status_code == 200, served.text


def test_bs_unread_answer_is_dropped_once_b_stops_reading(server: ServerProcess) -> None:
    """B asks for a 32 MB answer and never reads it. Once none of it has been read for
    body_timeout_s (1 s here), the connection is cut, and the answer's memory and the
    connection's place among max_connections are free again. Before, both were held for
    as long as B kept its socket open (its concurrency slot was let go long before: an
    unread answer was free for B), so B could hold gigabytes with answers it never read."""
    body = orjson.dumps({**scripted_inputs(rows=8), "parameters": {"binary_data_output": True}})
    head = (
        "POST /v2/models/big/infer HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: Bearer {BOB}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    assert server.process is not None
    gateway = psutil.Process(server.process.pid)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing anyway
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(head.encode() + body)
        port = sock.getsockname()[1]

        def still_open() -> bool:
            return any(
                c.raddr and c.raddr.port == port and c.laddr.port == server.port
                for c in gateway.net_connections("tcp")
            )

        wait_until(still_open, 20, "the gateway to accept the connection")
        wait_until(lambda: not still_open(), 20, "the gateway to drop the unread answer")
