"""The remote runtime's rules on an injected clock, in-process: outlier ejection (Envoy's
meanings), health thresholds, least-request choice, retries and their budget."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from infergate.clock import FakeClock
from infergate.engine.remote.balancer import Balancer, RetryBudget
from infergate.engine.remote.client import RemotePool, UpstreamReply, answered, passed_on
from infergate.engine.remote.config import RemoteConfig
from infergate.engine.remote.health import HealthChecks
from infergate.engine.remote.http1 import Http1Pool, Payload, Reply, read_reply
from infergate.engine.remote.outlier import OutlierDetector, OutlierPolicy
from infergate.engine.remote.served import verified_config
from infergate.engine.remote.slots import FairSlots, Turn
from infergate.engine.repository.config_override import ConfigOverrides
from infergate.engine.repository.modelconfig import parse_model_config
from infergate.engine.repository.scan import scan_model
from infergate.engine.repository.verify import (
    VerificationFailed,
    VerifyPolicy,
    generate_key,
    load_private_key,
    load_public_key,
    sign_file,
)
from infergate.errors import (
    BrokenReply,
    ConfigError,
    ConnectFailed,
    PoolTimeout,
    QueueDeadlineExceeded,
    UpstreamAnswered,
    UpstreamFailed,
)
from tests.remote_upstream import Upstream

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def detector(clock: FakeClock, count: int = 2, **policy: float) -> OutlierDetector:
    names = [f"http://h{i}:1" for i in range(count)]
    return OutlierDetector(names, OutlierPolicy(**policy), clock)  # type: ignore[arg-type]


def fail(d: OutlierDetector, endpoint: str, times: int) -> None:
    for _ in range(times):
        d.failure(endpoint)


def test_five_consecutive_5xx_eject_and_a_success_resets_the_count() -> None:
    clock = FakeClock()
    d = detector(clock)
    h0 = "http://h0:1"
    fail(d, h0, 4)
    d.success(h0)
    fail(d, h0, 4)
    assert not d.is_ejected(h0)
    d.failure(h0)
    assert d.is_ejected(h0)


def test_ejection_lasts_30_s_times_the_ejections_and_ends_at_a_sweep() -> None:
    clock = FakeClock()
    d = detector(clock)
    h0 = "http://h0:1"
    fail(d, h0, 5)  # ejected at t=0 (sweeps at 10, 20, 30, ...)
    clock.advance(29.99)
    assert d.is_ejected(h0)
    clock.advance(0.01)
    assert not d.is_ejected(h0)  # the sweep at 30 s returns it
    fail(d, h0, 5)  # second ejection at t=30: 60 s
    clock.advance(59.99)
    assert d.is_ejected(h0)
    clock.advance(0.01)
    assert not d.is_ejected(h0)
    # In service for one interval lowers the multiplier: the next ejection is 60 s, not 90.
    clock.advance(10)
    assert not d.is_ejected(h0)  # sweep at 100: multiplier 2 -> 1
    fail(d, h0, 5)  # at t=100: 2 x 30 s
    clock.advance(59.99)
    assert d.is_ejected(h0)
    clock.advance(0.01)
    assert not d.is_ejected(h0)


def test_a_sweep_returns_an_endpoint_late_when_its_time_is_between_sweeps() -> None:
    clock = FakeClock()
    d = detector(clock)
    h0 = "http://h0:1"
    clock.advance(5)
    fail(d, h0, 5)  # ejected until 35; sweeps at 10, 20, 30, 40
    clock.advance(30.5)  # t=35.5
    assert d.is_ejected(h0)
    clock.advance(4.5)  # t=40
    assert not d.is_ejected(h0)


def test_ejection_time_is_capped_by_max_ejection_time() -> None:
    clock = FakeClock()
    d = detector(clock, base_ejection_time_s=30, max_ejection_time_s=50, interval_s=1)
    h0 = "http://h0:1"
    for _ in range(3):
        fail(d, h0, 5)
        clock.advance(50)
        assert not d.is_ejected(h0)
    assert d.states[h0].ejections == 3


@pytest.mark.parametrize(("count", "most"), [(2, 1), (3, 1), (10, 1), (20, 2), (35, 3)])
def test_at_most_max_ejection_percent_but_at_least_one(count: int, most: int) -> None:
    clock = FakeClock()
    d = detector(clock, count)
    for endpoint in list(d.states):
        fail(d, endpoint, 5)
    assert d.ejected_count() == most


def test_health_thresholds() -> None:
    changes: list[tuple[str, bool]] = []
    h = HealthChecks([A], 2, 2, lambda e, ok, why: changes.append((e, ok)))
    h.record(A, False, "refused")
    assert h.is_healthy(A)
    h.record(A, False, "refused")
    assert not h.is_healthy(A)
    h.record(A, True)
    assert not h.is_healthy(A)
    h.record(A, True)
    assert h.is_healthy(A)
    assert changes == [(A, False), (A, True)]


def balancer(endpoints: list[str], seed: int = 1) -> tuple[Balancer, HealthChecks, OutlierDetector]:
    health = HealthChecks(endpoints, 1, 1)
    outliers = OutlierDetector(endpoints, OutlierPolicy(), FakeClock())
    return Balancer(endpoints, health, outliers, random.Random(seed)), health, outliers


def test_power_of_two_choices_never_picks_the_busiest() -> None:
    b, _, _ = balancer([A, B, C])
    b.active.update({A: 5, B: 1, C: 0})
    picks = [b.pick() for _ in range(300)]
    assert A not in picks
    assert picks.count(C) > picks.count(B)  # C wins both pairs it is in, B only (A, B)


def test_unavailable_endpoints_are_skipped_unless_all_are() -> None:
    b, health, outliers = balancer([A, B, C])
    health.record(A, False, "down")
    fail(outliers, B, 5)
    assert {b.pick() for _ in range(50)} == {C}
    assert b.pick(exclude=[C]) in (A, B)  # panic: all are candidates again
    assert b.pick(exclude=[A, B, C]) is None


def test_retry_budget_is_a_share_of_requests_in_flight_with_a_minimum() -> None:
    budget = RetryBudget(20.0, 3)
    budget.requests = 10
    assert [budget.try_acquire() for _ in range(4)] == [True, True, True, False]
    budget.requests = 100
    assert sum(budget.try_acquire() for _ in range(30)) == 17  # 20 in all


class FakeSender:
    """An endpoint that answers `what`: a status, or "refuse" (never connects)."""

    def __init__(self, what: int | str) -> None:
        self.what = what
        self.calls = 0

    async def request(
        self,
        path: str,
        headers: dict[str, str],
        body: Payload,
        connect_s: float,
        pool_s: float,
        turn: Turn = (0, None),
    ) -> Reply:
        self.calls += 1
        if self.what == "refuse":
            raise ConnectFailed("connection refused")
        status = int(self.what)
        return Reply(status, {"content-type": "application/json"}, b'{"error": "no"}')

    async def close(self) -> None:
        pass


def pool(
    handler: dict[str, int | str], clock: FakeClock, **settings: object
) -> tuple[RemotePool, dict[str, FakeSender]]:
    senders = {e: FakeSender(what) for e, what in handler.items()}
    config = RemoteConfig(tuple(handler), **settings)  # type: ignore[arg-type]
    return RemotePool(config, clock, rng=random.Random(3), sender=senders.__getitem__), senders


async def forward(p: RemotePool, clock: FakeClock) -> int:
    now = clock.now()
    reply = await p.forward("/v2/models/m/infer", b"{}", {}, now + 1, now + 5)
    return reply.status


@pytest.mark.parametrize("failure", ["refuse", 503])
async def test_connection_failures_and_503_go_to_another_endpoint(failure: int | str) -> None:
    clock = FakeClock()
    p, senders = pool({A: failure, B: 200}, clock)
    statuses = [await forward(p, clock) for _ in range(20)]
    assert statuses == [200] * 20
    assert senders[B].calls == 20
    assert 0 < senders[A].calls <= 5  # then ejected: 5 consecutive failures
    await p.close()


async def test_500_and_4xx_are_not_retried() -> None:
    clock = FakeClock()
    p, senders = pool({A: 500, B: 400}, clock)
    statuses = sorted([await forward(p, clock) for _ in range(4)])
    assert sum(s.calls for s in senders.values()) == 4
    assert set(statuses) <= {400, 500}
    await p.close()


async def test_retries_stop_at_the_limit_and_the_budget() -> None:
    clock = FakeClock()
    p, senders = pool({A: "refuse", B: "refuse", C: "refuse"}, clock, retries=1)
    with pytest.raises(UpstreamFailed, match="connection refused"):
        await forward(p, clock)
    assert sum(s.calls for s in senders.values()) == 2  # one try, one retry
    p, senders = pool({A: 503, B: 503}, clock, min_retry_concurrency=0, retry_budget_percent=0)
    with pytest.raises(UpstreamAnswered) as raised:
        await forward(p, clock)
    assert raised.value.status == 503
    assert sum(s.calls for s in senders.values()) == 1  # no budget: no retry
    await p.close()


async def test_a_request_past_its_deadline_is_not_sent() -> None:
    clock = FakeClock()
    p, senders = pool({A: 200}, clock)
    now = clock.now()
    with pytest.raises(QueueDeadlineExceeded):
        await p.forward("/v2/models/m/infer", b"{}", {}, now, now + 5)
    assert senders[A].calls == 0
    await p.close()


def write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text(text)
    return folder / "model.toml"


def test_a_remote_model_is_version_1_of_its_model_toml(tmp_path: Path) -> None:
    write(tmp_path / "m", 'runtime = "remote"\n[remote]\nendpoints = ["http://h:8000/"]\n')
    entry = scan_model(tmp_path, "m")
    assert entry is not None
    assert entry.problem is None
    (version,) = entry.versions
    assert (version.version, version.runtime) == (1, "remote")
    assert entry.config.remote is not None
    assert entry.config.remote.endpoints == ("http://h:8000",)
    assert entry.config.remote.consecutive_5xx == 5


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('runtime = "remote"\n', "needs at least one endpoint. Hint"),
        ('runtime = "remote"\n[remote]\nendpoints = ["h:80"]\n', "is not a V2 base URL"),
        ('[remote]\nendpoints = ["http://h"]\n', 'needs runtime = "remote"'),
        (
            'runtime = "remote"\n[remote]\nendpoints = ["http://h"]\nretry = 2\n',
            "unknown key remote.retry",
        ),
    ],
)
def test_bad_remote_settings_name_the_problem(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_model_config(write(tmp_path / "m", text))


async def test_http1_pool_reuses_connections_and_names_its_failures() -> None:
    upstream = Upstream().start()
    try:
        p = Http1Pool(upstream.url, max_connections=2, max_keepalive=1)
        path = f"/v2/models/{upstream.model}/infer"
        headers = {"Content-Type": "application/json"}
        for body in (b'{"inputs": []}', b"x" * 100_000):
            reply = await p.request(path, headers, body, 1.0, 1.0)
            assert reply.status == 200
            assert reply.headers["content-type"] == "application/json"
        assert [r.sha256 for r in upstream.received] == [
            hashlib.sha256(b'{"inputs": []}').hexdigest(),
            hashlib.sha256(b"x" * 100_000).hexdigest(),
        ]
        assert upstream.connections == 1  # kept alive between the two
        upstream.mode = "one_shot"  # closes each connection after its answer, silently
        for _ in range(5):
            reply = await p.request(path, headers, b"{}", 1.0, 1.0)
            assert reply.status == 200
        assert len(upstream.received) == 7  # each sent once, though 4 found it closed
        assert upstream.connections >= 5
        upstream.mode = "close"
        with pytest.raises(BrokenReply):
            await p.request(path, headers, b"{}", 1.0, 1.0)
        # On a new connection, a close before the answer is the upstream's doing after it
        # took the request (a crash on it): sent once, not again as if found stale (the
        # model ran twice, and a sequence's step advanced twice, with retries = 0).
        sent = len(upstream.received)
        with pytest.raises(BrokenReply, match="closed the connection unanswered"):
            await Http1Pool(upstream.url, 1, 1).request(path, headers, b"{}", 1.0, 1.0)
        assert len(upstream.received) == sent + 1
        await p.close()
    finally:
        upstream.stop()
    with pytest.raises(ConnectFailed):
        await Http1Pool(upstream.url, 1, 1).request(path, headers, b"{}", 1.0, 1.0)


def test_the_readme_remote_example_parses_to_the_defaults(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Remote models", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    config = parse_model_config(write(tmp_path / "resnet", example))
    assert config.remote is not None
    assert config.remote.endpoints == ("http://10.0.0.5:8000", "http://10.0.0.6:8000")
    assert (config.remote.model, config.remote.version) == ("resnet50", "3")
    defaults = RemoteConfig(config.remote.endpoints, "resnet50", "3")
    assert config.remote == defaults  # the values it shows are the defaults


async def test_http1_pool_waits_for_a_free_connection_only_so_long() -> None:
    upstream = Upstream(delay_s=30).start()
    try:
        p = Http1Pool(upstream.url, max_connections=1, max_keepalive=1)
        path = f"/v2/models/{upstream.model}/infer"
        first = asyncio.create_task(p.request(path, {}, b"{}", 1.0, 1.0))
        await wait_for_async(lambda: len(upstream.received) == 1)
        with pytest.raises(PoolTimeout):
            await p.request(path, {}, b"{}", 1.0, 0.05)
        assert len(upstream.received) == 1  # the second never went out
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await p.close()
    finally:
        upstream.stop()


async def wait_for_async(check: Callable[[], bool], timeout_s: float = 10) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


@pytest.mark.parametrize(
    ("status", "retry_after", "expected"),
    [
        (503, b"2", (503, 2.0)),
        (503, b"nan", (503, None)),
        (503, b"inf", (503, None)),
        (429, b"-1", (429, None)),
        (999, b"1", (502, None)),
        (302, None, (502, None)),
    ],
)
def test_an_upstream_error_is_passed_on_only_as_a_status_and_retry_after_a_client_can_use(
    status: int, retry_after: bytes | None, expected: tuple[int, float | None]
) -> None:
    headers = [] if retry_after is None else [(b"retry-after", retry_after)]
    error = answered(UpstreamReply(status, headers, b'{"error": "busy"}', "http://u:1", 1))
    assert (error.status, error.retry_after_s) == expected
    assert "busy" in str(error)


def test_upstream_headers_with_control_characters_are_not_passed_on() -> None:
    headers = {
        "content-type": "application/json\x01",
        "inference-header-content-length": "12",
        "retry-after": "2\x7f",
        "x-other": "kept upstream only",
    }
    assert passed_on(headers) == [(b"inference-header-content-length", b"12")]


REMOTE_TOML = 'runtime = "remote"\n[remote]\nendpoints = ["http://h:8000/"]\n'


def test_with_signed_models_required_a_remote_model_s_toml_must_be_signed(tmp_path: Path) -> None:
    """A remote model has no model file: its model.toml names the endpoints that serve.
    With `require_signed_models`, anyone who could write to the repository turned a
    signed model into a remote one at their own server by editing model.toml: it served
    (200, the inputs sent to them) unsigned. Now that model.toml is verified as a model
    file is, and what serves is what was verified."""
    key_path = tmp_path / "team.key"
    policy = VerifyPolicy(True, (load_public_key(generate_key(key_path)),))
    toml = write(tmp_path / "m", REMOTE_TOML)

    def scanned() -> str | None:
        entry = scan_model(tmp_path, "m")
        assert entry is not None
        return entry.toml_sha256

    with pytest.raises(VerificationFailed, match="is not signed and the profile requires"):
        verified_config(toml, scanned(), policy)
    sign_file(toml, load_private_key(key_path))
    digest = hashlib.sha256(toml.read_bytes()).hexdigest()
    assert verified_config(toml, scanned(), policy) == digest
    assert verified_config(toml, scanned(), VerifyPolicy()) == digest
    # Another model.toml, not signed by a trusted key: refused.
    toml.write_text(REMOTE_TOML.replace("h:8000", "evil:8000"))
    with pytest.raises(VerificationFailed, match="does not verify against any trusted key"):
        verified_config(toml, scanned(), policy)
    # Swapped for a signed one after the scan read it: what was read is not what verified.
    before = scanned()
    sign_file(toml, load_private_key(key_path))
    toml.write_text(REMOTE_TOML)
    sign_file(toml, load_private_key(key_path))
    with pytest.raises(VerificationFailed, match="changed while it was verified"):
        verified_config(toml, before, policy)


def test_a_remote_model_loaded_with_a_config_override_still_verifies(tmp_path: Path) -> None:
    """A load's `parameters.config` changes the configuration, not the model.toml that was
    verified: its bytes' digest goes with the overridden entry (a comparison of the
    configurations refused every such load as "changed while it was verified")."""
    toml = write(tmp_path / "m", REMOTE_TOML)
    overrides = ConfigOverrides()
    overrides.set("m", {"max_batch_size": 8})
    entry = overrides.apply(scan_model(tmp_path, "m"))
    assert entry is not None
    assert entry.config.batching.max_batch_size == 8
    digest = hashlib.sha256(toml.read_bytes()).hexdigest()
    assert verified_config(toml, entry.toml_sha256, VerifyPolicy()) == digest


async def reply_of(raw: bytes, max_body: int = 100) -> Reply:
    """What the pool reads of the answer `raw`, taking at most `max_body` bytes of body."""
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    head = await reader.readuntil(b"\r\n\r\n")
    reply, _ = await read_reply(head, reader, max_body)
    return reply


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length '-1'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello", "bad Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
            "bad chunk size",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 101\r\n\r\n", "larger than the 0 MB allowed"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"40\r\n"
            + b"x" * 64
            + b"\r\n"
            + b"40\r\n"
            + b"x" * 64
            + b"\r\n0\r\n\r\n",
            "larger than the 0 MB allowed",
        ),
        (b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 101, "larger than the 0 MB allowed"),
    ],
)
async def test_an_upstream_answer_that_is_malformed_or_too_large_is_a_broken_reply(
    raw: bytes, error: str
) -> None:
    """A negative length was a 500 with a traceback a request, its endpoint never ejected;
    an answer of 1.5 GB was held whole twice (3 GB) while the event loop stalled 9.9 s for
    every tenant. Each is a broken reply now (a 502, counted against the endpoint), read
    no further than `max_answer_mb`."""
    with pytest.raises(BrokenReply, match=error):
        await reply_of(raw)


async def test_an_upstream_answer_at_the_limit_is_read_whole() -> None:
    for raw in (
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n"
        + b"x" * 100
        + b"\r\n0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 100,
    ):
        assert (await reply_of(raw)).body == b"x" * 100


async def hostile_health(mode: str, writers: list[asyncio.StreamWriter]) -> asyncio.Server:
    """An endpoint whose GET /v2/health/ready answers 200 with a chunked body that never
    ends ("endless": 64 KB chunks as fast as they go) or drips a byte every 50 ms; its
    connections' writers go to `writers`, for the test to close."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                if mode == "endless":
                    writer.write(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
                    await writer.drain()
                else:
                    writer.write(b"1\r\nx\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.05)  # (the drip itself, not a test's wait)
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize("mode", ["endless", "drip"])
async def test_a_health_check_is_bounded_in_size_and_time(mode: str) -> None:
    """httpx's timeout bounds each read, not an answer: an endpoint whose health answer
    never ended grew the gateway by 2.7 GB in 12 s, and one that dripped a byte at a time
    held every endpoint's checks (they run as one round) for good. A check now fails past
    4 MB or past health_timeout_s, whole, and the round goes on."""
    writers: list[asyncio.StreamWriter] = []
    server = await hostile_health(mode, writers)
    port = server.sockets[0].getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    pool = RemotePool(RemoteConfig((endpoint,), health_timeout_s=0.5), FakeClock())
    try:
        started = asyncio.get_running_loop().time()
        await pool.check_health()
        elapsed = asyncio.get_running_loop().time() - started
        state = pool.health.states[endpoint]
        assert state.fails == 1
        why = (
            "larger than the 4 MB allowed" if mode == "endless" else "no whole answer within 0.5 s"
        )
        assert why in (state.last_error or "")
        assert elapsed < 30  # (it ended: before, the drip never did)
    finally:
        await pool.close()
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def test_connection_slots_go_by_class_then_tenants_in_turn() -> None:
    """A remote endpoint's connections were a semaphore, first come first served: tenant
    A's 40 requests in flight held B's lone request 10 s, and a burst request got a 504
    behind batch ones. A free slot now goes to the best class waiting, and within a class
    to the tenants in turn."""
    slots = FairSlots(1)
    await slots.acquire((2, "a"))  # the one slot, held
    order: list[str] = []

    def wait(rank: int, tenant: str, name: str) -> asyncio.Task[None]:
        async def take() -> None:
            await slots.acquire((rank, tenant))
            order.append(name)

        return asyncio.create_task(take())

    waiting = [wait(2, "a", f"a{i}") for i in range(1, 4)]
    waiting.append(wait(2, "b", "b1"))
    await asyncio.sleep(0)  # (each task runs to its wait)
    waiting.append(wait(0, "c", "c-realtime"))  # last in, best class
    gone = wait(2, "b", "b-gone")
    await asyncio.sleep(0)
    gone.cancel()  # gave up waiting: never served
    for _ in range(5):
        slots.release()
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert order == ["c-realtime", "a1", "b1", "a2", "a3"]
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    slots.release()  # the last holder's: nobody waits, the slot is free again
    await asyncio.wait_for(slots.acquire((2, "z")), 1)


async def test_an_answer_to_the_connection_s_end_is_read_to_its_end() -> None:
    """An answer without a length, delimited by the connection's end, was cut to what
    had arrived at the first read: a 200 with part of its body."""
    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.0 200 OK\r\n\r\n" + b"a" * 60)
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, reader.feed_data, b"b" * 40)  # (the rest arrives later)
    loop.call_later(0.02, reader.feed_eof)
    head = await reader.readuntil(b"\r\n\r\n")
    reply, keep = await read_reply(head, reader, 100)
    assert (reply.body, keep) == (b"a" * 60 + b"b" * 40, False)


async def test_interim_answers_are_skipped_and_never_answer_the_next_request() -> None:
    """An upstream's 103 Early Hints before its 200 was taken as the answer (a 502), and
    the 200 stayed unread on the kept connection: the next request, perhaps another
    tenant's, got it."""
    served = 0
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                served += 1
                body = b"answer%d" % served
                writer.write(
                    b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
                    + b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Http1Pool(f"http://127.0.0.1:{port}", 1, 1)
    try:
        for n in (1, 2, 3):
            reply = await pool.request("/v2/models/m/infer", {}, b"{}", 1.0, 1.0)
            assert (reply.status, reply.body) == (200, b"answer%d" % n)
    finally:
        await pool.close()
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()
