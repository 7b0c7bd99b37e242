"""Tenant B (careless or hostile) against tenant A on one real server: what B sends
must not fail, refuse or starve A's requests. B's backlog does not fill A's share of a
queue; B's failing, crashing, slow or memory-hungry request does not take down the A
request batched with it; B's failures cut off B alone, whether or not A's requests come
meanwhile; and B's sequences do not take every place of a model's max_sequences."""

from __future__ import annotations

import asyncio
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

from infergate.clock import FakeClock
from infergate.engine.admission.breaker import Breaker, BreakerPolicy
from infergate.engine.admission.tenants import hash_key
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import Fairness, Job, JobQueue, QueueFull, QueuePolicy
from infergate.server.decoding import BodyDecoder
from tests.polling import eventually, wait_until
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


def test_bs_failing_request_does_not_fail_as_request_in_its_batch(
    server: ServerProcess, gates: Path
) -> None:
    """A's and B's requests wait behind a held one and run as one batch, where B's input
    makes the model raise: A's rows are answered, only B gets the 500."""
    sent = Background()
    holder = sent.send(lambda: post(server, "failing", BOB, scripted_inputs(hold=201, fail=0)))
    wait_until(lambda: holding(gates, 201), what="the held request to run")
    alice = sent.send(lambda: post(server, "failing", ALICE, scripted_inputs(hold=0, fail=0)))
    bob = sent.send(lambda: post(server, "failing", BOB, scripted_inputs(hold=0, fail=1)))
    wait_until(lambda: queued(server, "failing") == 2, what="A's and B's requests to queue")
    release(gates, 201)
    assert sent.status(holder) == 200
    assert sent.status(bob) == 500
    assert sent.status(alice) == 200, sent.answers[alice].text


def test_bs_crashing_request_does_not_fail_as_request_in_its_batch(
    server: ServerProcess, gates: Path
) -> None:
    """A's and B's requests run as one batch, and B's input ends the worker process. The
    retry on the sibling runs each request alone: B's does not take A's down a second
    time, and A gets its answer. Before, both were retried as one batch again, killing the
    sibling too, and A got 503."""
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
    sent = Background()
    holder = sent.send(lambda: post(server, "slowpoke", BOB, scripted_inputs(hold=501)))
    wait_until(lambda: holding(gates, 501), what="the held request to run")
    alice = sent.send(lambda: post(server, "slowpoke", ALICE, scripted_inputs(hold=0)))
    # 502 is never let go: B's request holds its batch, and itself alone, past the timeout.
    bob = sent.send(lambda: post(server, "slowpoke", BOB, scripted_inputs(hold=502)))
    wait_until(lambda: queued(server, "slowpoke") == 2, what="A's and B's requests to queue")
    release(gates, 501)
    assert sent.status(bob) == 504, sent.answers[bob].text
    assert sent.status(alice) == 200, sent.answers[alice].text
    sent.status(holder)  # 200, or 504 on a machine slow enough to let it time out first


def test_bs_memory_hungry_request_does_not_fail_as_request_in_its_batch(
    server: ServerProcess, gates: Path
) -> None:
    """A's and B's requests run as one batch, where B's input takes more than the
    model's memory_mb: the worker is killed, and each request runs again alone. A's is
    answered; B's, killed again alone, gets the 503. Before, neither ran again."""
    sent = Background()
    holder = sent.send(lambda: post(server, "greedy", BOB, scripted_inputs(hold=601, alloc_mb=0)))
    wait_until(lambda: holding(gates, 601), what="the held request to run")
    alice = sent.send(lambda: post(server, "greedy", ALICE, scripted_inputs(hold=0, alloc_mb=0)))
    bob = sent.send(lambda: post(server, "greedy", BOB, scripted_inputs(hold=602, alloc_mb=400)))
    wait_until(lambda: queued(server, "greedy") == 2, what="A's and B's requests to queue")
    release(gates, 601)
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
    sent = Background()
    holder = sent.send(lambda: post(server, "fragile", BOB, scripted_inputs(hold=701, crash=0)))
    wait_until(lambda: holding(gates, 701), what="the held request to run")
    alice = sent.send(lambda: post(server, "fragile", ALICE, scripted_inputs(hold=0, crash=0)))
    bob = sent.send(lambda: post(server, "fragile", BOB, scripted_inputs(hold=0, crash=1)))
    wait_until(lambda: queued(server, "fragile") == 2, what="A's and B's requests to queue")
    release(gates, 701)
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


async def test_bs_large_bodies_do_not_hold_up_as_in_the_decoder() -> None:
    """B sends six large JSON bodies at once, then A one: the helper process that decodes
    large bodies takes the tenants in turn, so A's is decoded right after the one in hand,
    not after B's whole backlog (before: first in, first out, however many B sent)."""
    body = orjson.dumps(scripted_inputs(rows=64))
    decoder = BodyDecoder(inline_max_bytes=16)  # every body counts as large
    done: list[str] = []

    async def decode(tenant: str) -> None:
        decoded = await decoder.decode(body, None, None, tenant)
        assert decoded.inputs["x"].shape == (64, 4)
        done.append(tenant)

    try:
        await asyncio.gather(*(decode("bob") for _ in range(6)), decode("alice"))
    finally:
        decoder.close()
    assert done.index("alice") <= 1, done


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


# ---- the same rules as pure logic, on an injected clock ----

POLICY = BreakerPolicy(
    window_seconds=1,
    failure_rate=0.3,
    latency_p99_ms=100,
    consecutive_windows=1,
    min_requests=4,
    backoff_initial_s=2,
    backoff_max_s=5,
    probes=1,
)


def state(breaker: Breaker) -> str:
    """The breaker's state now (a call: mypy would narrow a property read twice)."""
    return breaker.state


def outcomes(breaker: Breaker, clock: FakeClock, **tenants: bool) -> None:
    """A request of each tenant named (True: it succeeds) that the breaker lets through,
    then one bucket later."""
    for tenant, ok in tenants.items():
        if breaker.allow(tenant) == "normal":
            breaker.record("normal", ok, 0.01, tenant)
    clock.advance(0.1)


def test_a_breaker_cuts_off_the_one_tenant_that_fails_it() -> None:
    clock = FakeClock()
    cut: list[tuple[object, float]] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, _, backoff: cut.append((t, backoff)))
    for _ in range(3):
        outcomes(breaker, clock, alice=True, bob=False)
    assert cut == [("bob", 2)]
    assert breaker.state == "closed"
    assert breaker.allow("bob") == "refused"
    assert breaker.allow("alice") == "normal"
    assert breaker.retry_after("bob") == pytest.approx(1.9)
    assert breaker.retry_after("alice") == 0
    clock.advance(2)  # over: it keeps at it, and is cut off for twice as long
    for _ in range(3):
        outcomes(breaker, clock, alice=True, bob=False)
    assert cut[-1] == ("bob", 4)
    breaker.reset()
    assert breaker.allow("bob") == "normal"


def test_a_breaker_opens_when_the_model_fails_for_two_tenants_or_the_only_one() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        outcomes(breaker, clock, alice=False, bob=False)
    assert breaker.state == "open"
    lone = Breaker(POLICY, clock)
    for _ in range(5):
        outcomes(lone, clock, bob=False)  # no one else's requests: it cannot tell
    assert lone.state == "open"


def test_a_tenant_failing_alone_is_cut_off_once_the_model_served_another() -> None:
    """No other tenant's requests in the window, but A was served well before: B alone is
    cut off, saying so. A failing too (B cut off) opens it for everyone."""
    clock = FakeClock()
    cut: list[tuple[object, str]] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, why, _: cut.append((t, why)))
    outcomes(breaker, clock, alice=True)
    clock.advance(POLICY.window_seconds)  # A's request has left the window
    for _ in range(5):
        outcomes(breaker, clock, bob=False)
    assert state(breaker) == "closed"
    [(tenant, why)] = cut
    assert tenant == "bob"
    assert why == (
        "4 of its 4 requests in the window failed; no other tenant's requests came in "
        "the window, and another tenant's were served well before"
    )
    assert breaker.allow("bob") == "refused"
    assert breaker.allow("alice") == "normal"
    for _ in range(5):
        outcomes(breaker, clock, alice=False)
    assert state(breaker) == "open"


def test_a_tenant_running_slow_alone_is_cut_off_once_the_model_served_another() -> None:
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    outcomes(breaker, clock, alice=True)
    clock.advance(POLICY.window_seconds)
    for _ in range(5):
        if breaker.allow("bob") == "normal":
            breaker.record("normal", True, 0.5, "bob")  # above the 100 ms p99 limit
        clock.advance(0.1)
    assert state(breaker) == "closed"
    assert "p99 latency of its requests" in (breaker.cut_off("bob") or "")
    assert "no other tenant's requests came" in (breaker.cut_off("bob") or "")


def test_a_tenant_failing_alone_opens_it_when_no_other_was_served_well_since_it_opened() -> None:
    """A window of one tenant's requests opens it for everyone unless another tenant was
    served well since it last opened: not the tenant's own successes, not another's slow
    ones, not another's from before the model failed for all (the default tenant alone,
    where no tenants are configured, is the first case)."""
    clock = FakeClock()
    own = Breaker(POLICY, clock)
    outcomes(own, clock, bob=True)
    clock.advance(POLICY.window_seconds)
    for _ in range(5):
        outcomes(own, clock, bob=False)
    assert state(own) == "open"
    slow = Breaker(POLICY, clock)
    slow.record(slow.allow("alice"), True, 0.5, "alice")  # served, above the p99 limit
    clock.advance(POLICY.window_seconds)
    for _ in range(5):
        outcomes(slow, clock, bob=False)
    assert state(slow) == "open"
    before = Breaker(POLICY, clock)
    outcomes(before, clock, alice=True)
    for _ in range(5):
        outcomes(before, clock, alice=False, bob=False)  # the model fails for two
    assert state(before) == "open"
    clock.advance(POLICY.backoff_initial_s)
    assert before.allow("bob") == "probe"
    before.record("probe", True, 0.01, "bob")
    assert state(before) == "closed"
    for _ in range(5):
        outcomes(before, clock, bob=False)
    assert state(before) == "open"  # A's success came before the model failed for all


def test_a_tenant_whose_requests_alone_run_slow_is_cut_off() -> None:
    """B's inputs make the model slow (its p99 above the limit), A's run fast: B alone."""
    clock = FakeClock()
    breaker = Breaker(POLICY, clock)
    for _ in range(3):
        for tenant, latency in (("alice", 0.01), ("bob", 0.5)):
            if breaker.allow(tenant) == "normal":
                breaker.record("normal", True, latency, tenant)
        clock.advance(0.1)
    assert breaker.state == "closed"
    assert breaker.cut_off("bob") is not None
    assert "p99 latency" in (breaker.cut_off("bob") or "")
    assert breaker.cut_off("alice") is None


def test_a_cut_off_tenant_s_answers_in_flight_do_not_open_it_for_the_others() -> None:
    """B's requests admitted before its cut-off (in flight then) end after it, failing or
    slow, while A is served: they do not count, neither as the model failing nor as a
    second tenant failing it. Before, the next evaluation opened it for everyone."""
    for late_ok, late_latency in ((False, None), (True, 0.5)):  # failing, then slow
        clock = FakeClock()
        breaker = Breaker(POLICY, clock)
        in_flight = [breaker.allow("bob") for _ in range(8)]
        assert in_flight == ["normal"] * 8
        for _ in range(3):
            if breaker.allow("alice") == "normal":
                breaker.record("normal", True, 0.01, "alice")
            if breaker.allow("bob") == "normal":
                breaker.record("normal", late_ok, late_latency or 0.01, "bob")
            clock.advance(0.1)
        assert breaker.cut_off("bob") is not None
        for admission in in_flight:  # they end now, one a bucket, among A's successes
            breaker.record(admission, late_ok, late_latency, "bob")
            outcomes(breaker, clock, alice=True)
        assert state(breaker) == "closed", breaker.reason
        assert breaker.allow("alice") == "normal"
        assert breaker.window_stats()[1] == 0  # A's alone
        clock.advance(2)  # its cut-off is over: its answers count again
        for _ in range(3):
            outcomes(breaker, clock, alice=True, bob=False)
        assert breaker.cut_off("bob") is not None  # cut off again, not opened
        assert state(breaker) == "closed"


def test_a_tenant_whose_lone_requests_end_two_workers_is_cut_off() -> None:
    """A query of death: B's requests, each running alone, end a worker twice within the
    window, once A was served well: B is cut off, without min_requests, saying why, and
    neither run gets another try (it would end a sibling). Where nobody else was served
    (the default tenant alone, no tenants configured) nobody is cut off, and a lone
    request gets its try unless its tenant ended another worker within the window."""
    clock = FakeClock()
    cut: list[tuple[object, str]] = []
    breaker = Breaker(POLICY, clock, on_cut_off=lambda t, why, _: cut.append((t, why)))
    outcomes(breaker, clock, alice=True)
    assert breaker.worker_ended("bob", "crashed") is False
    assert not cut
    clock.advance(0.5)
    assert breaker.worker_ended("bob", "was killed for its memory") is False
    assert cut == [
        (
            "bob",
            "its requests ended 2 workers of this version within 1 s, each running alone "
            "(the last was killed for its memory)",
        )
    ]
    assert state(breaker) == "closed"
    assert breaker.allow("bob") == "refused"
    assert breaker.allow("alice") == "normal"
    assert breaker.worker_ended("bob", "crashed") is False  # one admitted before its cut-off
    assert len(cut) == 1
    # Deaths further apart than the window: none cut it off.
    apart = Breaker(POLICY, clock)
    outcomes(apart, clock, alice=True)
    apart.worker_ended("bob", "crashed")
    clock.advance(POLICY.window_seconds)
    apart.worker_ended("bob", "crashed")
    assert apart.cut_off("bob") is None
    # The default tenant alone: nobody to protect, and a first death may be chance.
    lone = Breaker(POLICY, clock)
    outcomes(lone, clock, default=True)
    assert lone.worker_ended("default", "crashed") is True
    assert lone.worker_ended("default", "crashed") is False  # it ended one already
    clock.advance(POLICY.window_seconds)
    assert lone.worker_ended("default", "crashed") is True
    assert lone.cut_off("default") is None
    assert state(lone) == "closed"
    assert lone.worker_ended(None, "crashed") is True  # an outcome naming nobody
    # A second tenant ending workers while one is cut off: the model, for everyone.
    two = Breaker(POLICY, clock)
    outcomes(two, clock, carol=True)
    for tenant in ("bob", "bob", "alice", "alice"):
        two.worker_ended(tenant, "crashed")
    assert state(two) == "open"
    assert "a second tenant's requests ended 2 workers" in two.reason


def test_a_full_queue_sheds_the_tenant_that_holds_most_of_it_never_its_equal() -> None:
    patient = PriorityClass("patient", 0, 60.0)
    queue: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=0, max_queue_size=4))

    def job(name: str, tenant: str, weight: float = 1.0) -> list[Job[str]]:
        return [Job(name, patient, 0.0, 60.0, fair=Fairness(tenant, weight))]

    for i in range(4):
        queue.admit(job(f"b{i}", "bob"))
    assert [v.payload for v in queue.admit(job("a0", "alice"))] == ["b3"]  # bob's last
    assert [v.payload for v in queue.admit(job("a1", "alice"))] == ["b2"]
    with pytest.raises(QueueFull):  # two each: neither sheds the other
        queue.admit(job("a2", "alice"))
    with pytest.raises(QueueFull):
        queue.admit(job("b4", "bob"))
    # A tenant of weight 3 holds three places for each of a tenant of weight 1.
    weighted: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=0, max_queue_size=4))
    for i in range(4):
        weighted.admit(job(f"b{i}", "bob"))
    shed = [v.payload for i in range(3) for v in weighted.admit(job(f"c{i}", "carol", 3.0))]
    assert shed == ["b3", "b2", "b1"]
    with pytest.raises(QueueFull):
        weighted.admit(job("c3", "carol", 3.0))


async def test_a_body_whose_client_gives_up_ends_its_turn_with_its_decoding() -> None:
    """A caller cancelled while it waits for its turn, or while the helper decodes its
    body, leaves the turns as they were: the next body is decoded once that is done."""
    body = orjson.dumps(scripted_inputs(rows=20_000))  # about a megabyte of JSON
    decoder = BodyDecoder(inline_max_bytes=16)
    try:
        await decoder.decode(body, None, None, "bob")  # the helper is up
        pool = decoder._helper()
        first = asyncio.create_task(decoder.decode(body, None, None, "bob"))
        waiting = asyncio.create_task(decoder.decode(body, None, None, "bob"))
        await eventually(lambda: pool._pending_work_items, what="the first body in the helper")
        waiting.cancel()
        first.cancel()
        for task in (first, waiting):
            with pytest.raises(asyncio.CancelledError):
                await task
        decoded = await asyncio.wait_for(decoder.decode(body, None, None, "alice"), 30)
        assert decoded.inputs["x"].shape == (20_000, 4)
    finally:
        decoder.close()
