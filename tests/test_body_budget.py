"""[server] max_bodies_mb: how many bytes of large request bodies the gateway holds at once.
A request whose body does not fit waits, unread, its tenant in turn with the others'; a
small one (the infer lane's 64 KiB or less) never waits for it. In one process and with a
front process, whose engine took 1.5 GB from a flood of 1 MB bodies before."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from infergate.errors import ConfigError
from infergate.profile import load_profile
from infergate.server.body_budget import BodyBudget
from tests.polling import wait_until
from tests.scrape import metric
from tests.scripted_runtime import holding, make_scripted, scripted_inputs
from tests.server import ServerProcess

# --- the budget itself ------------------------------------------------------------------


async def test_what_fits_is_taken_at_once_and_the_rest_waits_for_a_give() -> None:
    budget = BodyBudget(10)
    await budget.take("a", 5)
    await budget.take("b", 6)  # taken as 5: no body is larger than a tenant's half
    third = asyncio.ensure_future(budget.take("c", 3))
    await asyncio.sleep(0)
    assert not third.done()
    assert budget.waiting == 1
    assert budget.held == 10
    budget.give("a", 5)
    await third
    assert budget.waiting == 0
    assert budget.held == 8


async def test_tenants_take_turns_so_a_flood_delays_another_by_one_body() -> None:
    budget = BodyBudget(20)
    await budget.take("flood", 10)
    await budget.take("mid", 10)
    order: list[str] = []

    async def one(tenant: str, n: int) -> None:
        await budget.take(tenant, 10)
        order.append(f"{tenant}{n}")

    waiting = [asyncio.ensure_future(one("flood", n)) for n in range(1, 4)]
    await asyncio.sleep(0)
    waiting.append(asyncio.ensure_future(one("other", 1)))
    await asyncio.sleep(0)
    for holder in ("flood", "mid", "flood", "other", "flood"):
        budget.give(holder, 10)
        await asyncio.sleep(0)
    assert order == ["flood1", "other1", "flood2", "flood3"]


async def test_a_waiter_that_gives_up_lets_the_ones_behind_it_go() -> None:
    budget = BodyBudget(10)
    await budget.take("a", 4)
    await budget.take("b", 4)
    large = asyncio.ensure_future(budget.take("c", 5))  # 2 are free: it waits
    await asyncio.sleep(0)
    small = asyncio.ensure_future(budget.take("d", 2))  # fits, but waits behind `large`
    await asyncio.sleep(0)
    assert not small.done()
    large.cancel()
    await asyncio.sleep(0)  # the cancelled one hands its place on
    await asyncio.sleep(0)  # the one behind it runs
    assert small.done()
    assert budget.held == 10
    assert budget.waiting == 0


async def test_a_tenant_holds_at_most_half_so_its_slow_bodies_hold_up_only_its_own() -> None:
    budget = BodyBudget(10)
    await budget.take("slow", 5)  # its half: uploads that trickle in
    its_next = asyncio.ensure_future(budget.take("slow", 3))
    await asyncio.sleep(0)
    assert not its_next.done()  # 5 are free, but not for it
    await asyncio.wait_for(budget.take("other", 4), 1)  # not behind the slow one's
    assert budget.held == 9
    budget.give("slow", 5)
    await its_next
    assert budget.held == 7


async def test_a_sender_with_two_identities_leaves_room_for_a_third_tenant() -> None:
    """A key and anonymous access are two tenants: with half each, one sender held all
    of the budget, and another tenant's large requests waited their 10 s for a 503. A
    tenant that holds some already leaves a quarter free for those that hold none."""
    budget = BodyBudget(16)
    await budget.take("keyed", 4)
    await budget.take("keyed", 4)  # its half, 8 left free
    await budget.take("default", 4)  # its first body: 4 left, the reserve
    more = asyncio.ensure_future(budget.take("default", 4))
    await asyncio.sleep(0)
    assert not more.done()  # it holds some: the reserve is not for it
    await asyncio.wait_for(budget.take("victim", 4), 1)  # holds none: the reserve is its
    assert budget.held == 16
    budget.give("keyed", 4)
    budget.give("victim", 4)
    await asyncio.wait_for(more, 1)  # 8 free: its second body leaves the reserve
    assert budget.held == 12


def test_a_budget_smaller_than_twice_the_largest_body_is_refused_naming_the_fix(
    tmp_path: Path,
) -> None:
    profile = tmp_path / "profile.toml"
    profile.write_text("[server]\nmax_request_mb = 100\nmax_bodies_mb = 150\n")
    with pytest.raises(ConfigError) as caught:
        load_profile(profile)
    message = str(caught.value)
    assert "max_bodies_mb" in message
    assert "Set max_bodies_mb to 200 or more, or lower max_request_mb" in message


# --- a gateway holding one large body, the next one waiting -------------------------------

PAD = 600_000  # two such bodies do not fit in a tenant's half of 2 MB


def _start(tmp_path: Path, server_settings: str) -> tuple[ServerProcess, Path]:
    gates = tmp_path / "gates"
    gates.mkdir()
    models = tmp_path / "models"
    make_scripted(models / "held" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    make_scripted(models / "free" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    profile = tmp_path / "profile.toml"
    profile.write_text(
        f"[server]\nmax_bodies_mb = 2\nmax_request_mb = 1\n{server_settings}\n"
        # No queue deadline comes into it: what waits here waits for the body budget.
        '[classes.patient]\nrank = 0\ndeadline_ms = 60000\n[tenants.default]\nclass = "patient"\n'
    )
    return ServerProcess(models, profile, tmp_path / "server.log").start(), gates


@pytest.fixture(params=[0, 1], ids=["one-process", "fronts"])
def budget_server(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerProcess, Path]]:
    server, gates = _start(tmp_path, f"fronts = {request.param}")
    yield server, gates
    (gates / "release-1").touch()
    server.stop()


def _send(
    server: ServerProcess, model: str, hold: int, pad: int
) -> tuple[threading.Thread, list[int]]:
    statuses: list[int] = []
    body = {**scripted_inputs(hold=hold), "pad": "x" * pad}

    def send() -> None:
        answer = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)
        statuses.append(answer.status_code)

    thread = threading.Thread(target=send)
    thread.start()
    return thread, statuses


def test_a_large_body_waits_unread_for_room_while_small_ones_pass(
    budget_server: tuple[ServerProcess, Path],
) -> None:
    server, gates = budget_server
    held, held_status = _send(server, "held", hold=1, pad=PAD)
    wait_until(lambda: metric(server, "infergate_request_bodies_bytes") > PAD, 30)
    # To another model, whose worker is free: all it waits for is room for its body.
    waiting, waiting_status = _send(server, "free", hold=0, pad=PAD)
    wait_until(lambda: metric(server, "infergate_request_bodies_waiting") == 1, 30)

    # A small request is not in that line: answered while both large ones are held up.
    small = httpx.post(
        f"{server.url}/v2/models/free/infer", json=scripted_inputs(hold=0), timeout=30
    )
    assert small.status_code == 200
    assert not held_status
    assert not waiting_status
    assert metric(server, "infergate_request_bodies_waiting") == 1

    (gates / "release-1").touch()
    held.join(30)
    waiting.join(30)
    assert held_status == [200]
    assert waiting_status == [200]
    assert metric(server, "infergate_request_bodies_waiting") == 0
    assert metric(server, "infergate_request_bodies_bytes") == 0


def test_a_wait_for_room_past_half_the_body_timeout_is_a_503_naming_the_budget(
    tmp_path: Path,
) -> None:
    server, gates = _start(tmp_path, "body_timeout_s = 1")  # so a wait ends after 0.5 s
    try:
        held, held_status = _send(server, "held", hold=1, pad=PAD)
        wait_until(lambda: metric(server, "infergate_request_bodies_bytes") > PAD, 30)
        body = {**scripted_inputs(hold=0), "pad": "x" * PAD}
        answer = httpx.post(f"{server.url}/v2/models/free/infer", json=body, timeout=30)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert "max_bodies_mb" in answer.json()["error"]
        assert metric(server, "infergate_request_bodies_waiting") == 0
        (gates / "release-1").touch()
        held.join(30)
        assert held_status == [200]
        assert metric(server, "infergate_request_bodies_bytes") == 0
    finally:
        (gates / "release-1").touch()
        server.stop()


def test_a_compressed_body_holds_what_it_came_to_not_the_most_it_could(tmp_path: Path) -> None:
    """While it is read a gzip body takes the most it may inflate to (max_request_mb, here
    1 MB, the tenant's whole half); once read, only its inflated size, so it does not keep
    others out for the rest of its request."""
    server, gates = _start(tmp_path, "")
    try:
        inflated = orjson.dumps({**scripted_inputs(hold=1), "pad": " " * 300_000})
        statuses: list[int] = []

        def send() -> None:
            answer = httpx.post(
                f"{server.url}/v2/models/held/infer",
                content=gzip.compress(inflated),
                headers={"content-type": "application/json", "content-encoding": "gzip"},
                timeout=60,
            )
            statuses.append(answer.status_code)

        thread = threading.Thread(target=send)
        thread.start()
        wait_until(lambda: holding(gates, 1), 30)
        assert metric(server, "infergate_request_bodies_bytes") == len(inflated)
        (gates / "release-1").touch()
        thread.join(30)
        assert statuses == [200]
    finally:
        (gates / "release-1").touch()
        server.stop()
