"""The admin API against hostile and concurrent callers, in-process: the key is checked
from the headers before any body is read, and an admin body has a small limit of its own;
concurrent adds of one tenant hand out exactly one key, and it works; concurrent loads of
one model are each judged with their own config override. Races are driven by holding
what the requests queue on (the profile store's lock, a worker's start), never by time."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import ASGIApp, Message

from infergate.clock import FakeClock
from infergate.engine.admission.tenants import hash_key
from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.workers.messages import Ready, WorkerSpec
from infergate.profile import load_profile
from infergate.profile_store import ProfileStore
from infergate.server.admin import ADMIN_BODY_BYTES
from infergate.server.app import create_app
from tests.conftest import write_profile
from tests.fake_workers import FakeWorker, FakeWorkers
from tests.polling import eventually
from tests.scripted_runtime import make_scripted

ADMIN, TENANT = "admin-key", "tenant-key"
KEYED = f"""
[server]
admin_keys = ["{hash_key(ADMIN)}"]
allow_anonymous = true

[tenants.default]
class = "burst"

[tenants.team]
class = "burst"
api_keys = ["{hash_key(TENANT)}"]
"""
GIGABYTE = b"%d" % (1 << 30)
ADMIN_POSTS = ("/admin/tenants", "/v2/repository/models/m/load")


@dataclass
class Gateway:
    engine: Engine
    store: ProfileStore
    app: ASGIApp
    path: Path


@pytest.fixture
async def gateway_for(
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    """An in-process gateway for a profile (a 64 MB max_request_mb, the default), its
    model `m` served by in-process workers (`workers`: the factory)."""
    engines: list[Engine] = []

    async def start(profile: str, workers: Any = None) -> Gateway:
        path = write_profile(tmp_path, profile)
        models = tmp_path / "models"
        make_scripted(models / "m" / "1" / "model.scripted", controls=())
        loaded = load_profile(path)
        context = EngineContext(
            clock=FakeClock(),
            worker_factory=workers or FakeWorkers(),
            settings=loaded.live_settings(),
        )
        engine = Engine(EngineSettings(models, "explicit"), context)
        store = ProfileStore(path, loaded, engine)
        app, _ = create_app(engine, 64 << 20, store)
        await engine.start()
        engines.append(engine)
        await eventually(lambda: engine.ready and engine.version("m").ready, what="m loads")
        return Gateway(engine, store, app, path)

    yield start
    for engine in engines:
        await engine.stop()


async def _post(
    app: ASGIApp,
    path: str,
    headers: list[tuple[bytes, bytes]],
    receive: Callable[[], Awaitable[Message]],
) -> tuple[int, dict[str, Any]]:
    """A POST straight into the ASGI app, its body coming from `receive`."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"gateway"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, orjson.loads(body)


class CountedBody:
    """A body handed out in 64 KiB pieces, `pieces` of them, counting the reads."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        self.reads = 0

    async def __call__(self) -> Message:
        self.reads += 1
        more = self.reads < self.pieces
        return {"type": "http.request", "body": b" " * (64 << 10), "more_body": more}


@pytest.mark.parametrize("path", ADMIN_POSTS)
@pytest.mark.parametrize(
    ("key", "status"), [(None, 401), (TENANT, 403)], ids=["keyless", "tenant-key"]
)
async def test_a_caller_without_the_admin_key_is_refused_before_its_body_is_read(
    gateway_for: Callable[..., Awaitable[Gateway]], path: str, key: str | None, status: int
) -> None:
    # A keyless POST of 1 GB used to get its 401 only once the gateway held the 1 GB.
    gateway = await gateway_for(KEYED)
    body = CountedBody(pieces=1 << 14)
    headers = [(b"content-length", GIGABYTE)]
    if key is not None:
        headers.append((b"authorization", b"Bearer " + key.encode()))
    answer, doc = await _post(gateway.app, path, headers, body)
    assert (answer, body.reads) == (status, 0), doc
    assert "admin key" in doc["error"]


@pytest.mark.parametrize("path", ADMIN_POSTS)
async def test_an_admin_body_over_its_limit_is_refused_naming_the_limit(
    gateway_for: Callable[..., Awaitable[Gateway]], path: str
) -> None:
    gateway = await gateway_for(KEYED)
    admin = (b"authorization", b"Bearer " + ADMIN.encode())
    # A Content-Length over the limit: 413 before any of the body is read, though it is
    # far under max_request_mb (64 MB).
    declared = CountedBody(pieces=64)
    answer, doc = await _post(
        gateway.app, path, [admin, (b"content-length", b"%d" % (4 << 20))], declared
    )
    assert (answer, declared.reads) == (413, 0), doc
    assert "1 MB limit of /admin and repository requests" in doc["error"]
    # A body of no stated length (chunked) is cut where it passes the limit.
    chunked = CountedBody(pieces=64)  # 4 MB, if it were all read
    answer, doc = await _post(gateway.app, path, [admin], chunked)
    assert answer == 413, doc
    assert chunked.reads == ADMIN_BODY_BYTES // (64 << 10) + 1
    assert "1 MB limit" in doc["error"]


async def test_an_admin_body_at_its_limit_is_taken_whole(
    gateway_for: Callable[..., Awaitable[Gateway]],
) -> None:
    gateway = await gateway_for(KEYED)
    doc = orjson.dumps({"name": "padded", "models": ["m"]})
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        added = await client.post(
            "/admin/tenants",
            content=doc.ljust(ADMIN_BODY_BYTES),
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
        )
        assert added.status_code == 201, added.text
        assert gateway.engine.context.tenants.authenticate(added.json()["api_key"])


async def test_concurrent_adds_of_one_tenant_hand_out_one_key_that_works(
    gateway_for: Callable[..., Awaitable[Gateway]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each add checked that the tenant did not exist, then queued on the store's lock,
    and each in turn wrote the tenant with its own key: all got 201, only the last key
    worked. Here every add is held at the lock until all have passed that check."""
    gateway = await gateway_for(KEYED)
    store = gateway.store
    adds = 4
    held = threading.Event()
    arrived = asyncio.Event()
    edits = 0
    edit = store.edit

    def hold(_: object) -> None:  # runs in the store's thread, holding its lock
        held.wait(timeout=60)

    async def counted(change: Callable[..., None]) -> object:
        nonlocal edits
        edits += 1
        if edits == adds:
            arrived.set()
        return await edit(change)

    holder = asyncio.create_task(edit(hold))
    monkeypatch.setattr(store, "edit", counted)
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        posts = [
            asyncio.create_task(
                client.post(
                    "/admin/tenants",
                    json={"name": "acme", "models": ["m"]},
                    headers={"Authorization": f"Bearer {ADMIN}"},
                )
            )
            for _ in range(adds)
        ]
        await asyncio.wait_for(arrived.wait(), 60)  # every add is past the first check
        held.set()
        await holder
        answers = await asyncio.gather(*posts)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [201] + [409] * (adds - 1), [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 409)
    assert (
        "tenant 'acme' exists; change it with PATCH /admin/tenants/acme " in refused.json()["error"]
    )
    assert "(infergate tenant set acme FIELD=VALUE ...)" in refused.json()["error"]
    key = next(a.json()["api_key"] for a in answers if a.status_code == 201)
    assert gateway.engine.context.tenants.authenticate(key).tenant.name == "acme"
    assert gateway.path.read_text().count("[tenants.acme]") == 1


class GatedWorkers(FakeWorkers):
    """FakeWorkers whose start waits while `gate` is clear, and says when one does."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = asyncio.Event()

    def __call__(self, spec: WorkerSpec) -> FakeWorker:
        worker = GatedWorker(spec, self)
        self.made.append(worker)
        return worker


class GatedWorker(FakeWorker):
    def __init__(self, spec: WorkerSpec, factory: GatedWorkers) -> None:
        super().__init__(spec, None)
        self._factory = factory

    async def start(self, timeout_s: float) -> Ready:
        if not self._factory.gate.is_set():
            self._factory.waiting.set()
            await self._factory.gate.wait()
        return await super().start(timeout_s)


async def test_concurrent_loads_of_one_model_are_each_judged_with_their_own_override(
    gateway_for: Callable[..., Awaitable[Gateway]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load set its override before it took the model's lock, so the one that loaded
    could be another's: a load asking for a version that does not exist got 200 and a
    plain load 400. Here both wait for the lock (a reload holds it, its worker's start
    held) after each has set what it sets; then they run, one after the other."""
    workers = GatedWorkers()
    gateway = await gateway_for("[server]\n", workers)
    engine = gateway.engine
    workers.gate.clear()
    holder = asyncio.create_task(engine.load("m"))
    await asyncio.wait_for(workers.waiting.wait(), 60)  # the reload holds m's lock
    loads = 0
    arrived = asyncio.Event()
    load = engine.load

    async def counted(*args: Any) -> Any:
        nonlocal loads
        loads += 1
        if loads == 2:
            arrived.set()
        return await load(*args)

    monkeypatch.setattr(engine, "load", counted)
    missing = json.dumps({"version_policy": {"specific": {"versions": [99]}}})
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        url = "/v2/repository/models/m/load"
        bad = asyncio.create_task(client.post(url, json={"parameters": {"config": missing}}))
        plain = asyncio.create_task(client.post(url))
        await asyncio.wait_for(arrived.wait(), 60)  # both are at the lock
        workers.gate.set()
        await holder
        refused, loaded = await bad, await plain
    assert refused.status_code == 400, refused.text
    assert "failed to load 'm'" in refused.json()["error"]
    assert "selects none of the versions on disk" in refused.json()["error"]
    assert loaded.status_code == 200, loaded.text
    assert engine.registry.overrides.get("m") is None  # the plain load's: the files alone
    assert engine.version("m").ready
