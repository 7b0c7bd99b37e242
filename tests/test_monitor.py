"""The memory monitor in-process, through the worker seam: it reads the engine's frozen
snapshot of its workers (a loading version's included) and kills a worker past its
memory_mb, and only that one. Memory use comes from a fake device backend, so nothing
depends on what this machine's processes really use."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infergate.clock import FakeClock
from infergate.engine.admission.tenants import DEFAULT_TENANT, Tenant
from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.lifecycle.instance import with_hint
from infergate.engine.placement.devices import DeviceUsage, ProcessUsage
from infergate.engine.placement.monitor import MemoryMonitor
from infergate.engine.settings import LiveSettings
from infergate.engine.snapshots import WorkerView
from tests.fake_workers import FakeWorkers
from tests.polling import eventually
from tests.scripted_runtime import make_scripted


@dataclass
class FakeDevices:
    """A host whose processes use what the test says (MB by pid; unknown: not running)."""

    name: str = "fake"
    used_mb: dict[int, float] = field(default_factory=dict)
    others_mb: float | None = None  # what a process not in used_mb uses (None: not running)

    def devices(self) -> list[DeviceUsage]:
        return [DeviceUsage("cpu", "cpu", 0.0, 64_000.0, 0.0)]

    def process(self, pid: int) -> ProcessUsage | None:
        mb = self.used_mb.get(pid, self.others_mb)
        return None if mb is None else ProcessUsage(pid, mb, 0.0)

    def assign(self, pid: int, device: str) -> None:
        pass


@dataclass
class Host:
    engine: Engine
    devices: FakeDevices
    workers: FakeWorkers
    monitor: MemoryMonitor


@pytest.fixture
async def host(tmp_path: Path) -> AsyncIterator[Host]:
    models = tmp_path / "models"
    for name, toml in (("capped", "memory_mb = 300\n"), ("free", "")):
        make_scripted(models / name / "1" / "model.scripted", controls=())
        (models / name / "model.toml").write_text(toml)
    devices, workers = FakeDevices(), FakeWorkers()
    # The engine's own monitor samples every hour: the test drives a monitor of its own.
    context = EngineContext(
        clock=FakeClock(), worker_factory=workers, devices=devices, monitor_interval_s=3600
    )
    engine = Engine(EngineSettings(models, "explicit"), context)
    await engine.start()
    await eventually(lambda: engine.ready and engine.version("capped").ready, what="loads")
    await eventually(lambda: engine.version("free").ready, what="free to load")
    yield Host(
        engine,
        devices,
        workers,
        MemoryMonitor(engine.worker_views, engine.kill_over_memory, context),
    )
    await engine.stop()


async def test_the_snapshot_lists_only_workers_with_a_memory_limit(host: Host) -> None:
    views = host.engine.worker_views()
    capped = host.engine.version("capped").instances[0]
    assert [(w.model, w.version, w.instance, w.pid, w.memory_limit_mb) for w in views] == [
        ("capped", 1, 0, capped.pid, 300)
    ]


async def test_a_worker_past_its_limit_is_killed_and_restarted(host: Host) -> None:
    capped = host.engine.version("capped").instances[0]
    free = host.engine.version("free").instances[0]
    first = capped.pid
    assert first is not None
    assert free.pid is not None
    host.devices.used_mb = {first: 299.0, free.pid: 5000.0}  # under its limit; no limit
    await host.monitor.sample()
    assert capped.pid == first
    assert capped.ready
    assert free.ready
    host.devices.used_mb[first] = 301.0
    await host.monitor.sample()
    killed = next(w for w in host.workers.made if w.pid == first)
    assert killed.over_memory
    assert not killed.alive
    await eventually(lambda: capped.ready and capped.pid != first, what="the restart")
    assert free.ready  # the model without a limit is never touched
    events = [e for e in host.engine.context.events.recent() if e.kind == "worker_killed"]
    assert "instance 0 used 301 MB, over its limit of 300 MB" in events[-1].message


async def test_a_stale_sample_never_kills_the_worker_that_took_its_pid(host: Host) -> None:
    """A pid sampled for one instance that now belongs to another instance's worker (the
    first exited, the pid was reused) kills nothing."""
    free = host.engine.version("free").instances[0]
    assert free.pid is not None
    stale = WorkerView("capped", 1, 0, free.pid, 300)
    host.engine.kill_over_memory(stale, 301.0)
    worker = next(w for w in host.workers.made if w.pid == free.pid)
    assert worker.alive
    assert not worker.over_memory


async def test_an_open_breaker_shows_open_while_a_replacement_fails_to_load(
    host: Host,
) -> None:
    """The breaker gauge follows the version that serves: a new file for the same version
    that is loading, then fails, never shows the serving version's open breaker closed."""
    served = host.engine.version("capped")
    served.breaker._open("opened by the test")  # the state, not how it got there
    registry = host.engine.context.metrics.registry

    def gauge() -> float | None:
        labels = {"model": "capped", "version": "1"}
        return registry.get_sample_value("infergate_breaker_state", labels)

    assert gauge() == 2  # open
    host.workers.load_error = "the new file does not load"
    path = next((host.engine.settings.models_dir / "capped" / "1").glob("model.*"))
    path.write_text(path.read_text() + "# a new file\n")
    await host.engine.load("capped")
    assert host.engine.version("capped") is served  # the old version keeps serving
    assert gauge() == 2


def test_a_load_killed_over_memory_says_to_raise_the_limit_not_to_fix_the_file() -> None:
    killed = "worker pid 7 was killed: it used 900 MB, over its memory limit of 512 MB"
    assert with_hint(killed, over_memory=True).endswith("Hint: raise memory_mb in model.toml")
    assert with_hint("InvalidProtobuf").endswith("Hint: fix or replace the file")
    assert with_hint("took too long. Hint: raise load_timeout_s") == (
        "took too long. Hint: raise load_timeout_s"
    )


def engine_of(
    models: Path, *tenants: Tenant
) -> tuple[Engine, EngineContext, FakeDevices, FakeWorkers]:
    """An engine of `models` (loaded when asked) with `tenants`, on fake workers and
    devices, its monitor left to the test (`MemoryMonitor.sample`)."""
    devices, workers = FakeDevices(), FakeWorkers()
    context = EngineContext(
        clock=FakeClock(),
        worker_factory=workers,
        devices=devices,
        monitor_interval_s=3600,
        settings=LiveSettings(tenants=tenants),
    )
    return Engine(EngineSettings(models, "explicit"), context), context, devices, workers


async def test_a_tenant_s_workers_without_a_limit_share_its_memory_quota(tmp_path: Path) -> None:
    """Bob's quota is 1,000 MB: a model without memory_mb reserved none of it and was never
    watched (a warm-up of 3 GB served). Where the profile sets a tenant's memory_mb, the
    workers of its models without one share what its reservations leave (here 700 MB):
    past it together, the one that grew most is killed, saying so. A tenant whose memory_mb
    the profile leaves at its default is not held to it (a model may be larger)."""
    models = tmp_path / "models"
    tomls = {
        "reserved": 'tenant = "bob"\nmemory_mb = 300\n',
        "small": 'tenant = "bob"\n',
        "large": 'tenant = "bob"\n',
        "default": "",
    }
    for name, toml in tomls.items():
        make_scripted(models / name / "1" / "model.scripted", controls=())
        (models / name / "model.toml").write_text(toml)
    bob = Tenant("bob", memory_mb=1000, memory_enforced=True)
    engine, context, devices, workers = engine_of(models, Tenant(DEFAULT_TENANT), bob)
    await engine.start()
    try:
        await eventually(lambda: engine.ready, what="the models to load")
        ready = lambda: all(engine.version(name).ready for name in tomls)  # noqa: E731
        await eventually(ready, what="every model to load")
        monitor = MemoryMonitor(engine.worker_views, engine.kill_over_memory, context)
        pid: dict[str, int] = {}
        for name in tomls:
            worker_pid = engine.version(name).instances[0].pid
            assert worker_pid is not None
            pid[name] = worker_pid
        views = {v.model: v for v in engine.worker_views()}
        assert set(views) == {"reserved", "small", "large"}
        assert (views["large"].tenant, views["large"].tenant_left_mb) == ("bob", 700)
        devices.used_mb = {pid["reserved"]: 250, pid["small"]: 300, pid["large"]: 390}
        devices.used_mb[pid["default"]] = 5000  # (the default tenant: not held to 4,096)
        await monitor.sample()
        assert all(w.alive for w in workers.made)
        devices.used_mb[pid["large"]] = 450  # 750 together
        await monitor.sample()
        [killed] = [w for w in workers.made if not w.alive]
        assert killed.pid == pid["large"]
        assert killed.over_memory
        assert "one of tenant 'bob''s workers without a memory_mb" in killed.death_reason
        assert "750 MB together, over the 700 MB its memory quota leaves them" in (
            killed.death_reason
        )
    finally:
        await engine.stop()


async def test_a_reload_s_new_worker_is_watched_as_loading_until_it_serves(
    tmp_path: Path,
) -> None:
    """The engine shows the monitor a reload's new worker as loading (the one to kill
    first over its tenant's quota) while the old version serves, and as serving once the
    new version took over."""
    models = tmp_path / "models"
    make_scripted(models / "m" / "1" / "model.scripted", controls=())
    (models / "m" / "model.toml").write_text('tenant = "bob"\n')
    bob = Tenant("bob", memory_mb=1000, memory_enforced=True)
    engine, _, devices, workers = engine_of(models, bob)
    devices.others_mb = 42.0
    await engine.start()
    try:
        await eventually(lambda: engine.ready, what="version 1 to load")
        workers.loaded = loaded = asyncio.Event()
        make_scripted(models / "m" / "2" / "model.scripted", controls=())
        reload = asyncio.create_task(engine.load("m"))
        await eventually(lambda: len(engine.worker_views()) == 2, what="version 2's worker")
        views = {v.version: (v.loading, v.ready_mb) for v in engine.worker_views()}
        assert views == {1: (False, 42.0), 2: (True, None)}  # (its size when it was ready)
        loaded.set()
        await reload
        await eventually(lambda: [v.version for v in engine.worker_views()] == [2])
        assert [v.loading for v in engine.worker_views()] == [False]
    finally:
        await engine.stop()


async def test_over_its_tenant_s_quota_a_loading_worker_goes_before_a_serving_one() -> None:
    """A reload of a model without memory_mb: its new worker and the serving one are
    counted together against the tenant's quota, and the larger, serving, one was killed,
    its requests failing. The loading one goes first: the reload fails, as a reservation
    without room would refuse it."""
    devices = FakeDevices(used_mb={1: 500.0, 2: 300.0, 3: 100.0})
    views = [
        WorkerView("m", 1, 0, 1, 0, "bob", 700.0),
        WorkerView("m", 2, 0, 2, 0, "bob", 700.0, loading=True),
        WorkerView("n", 1, 0, 3, 0, "bob", 700.0),
    ]
    killed: list[tuple[int, float, float]] = []
    context = EngineContext(clock=FakeClock(), devices=devices)
    monitor = MemoryMonitor(
        lambda: views, lambda w, mb, all_mb: killed.append((w.pid, mb, all_mb)), context
    )
    await monitor.sample()
    assert killed == [(2, 300.0, 900.0)]
    killed.clear()
    views[1] = WorkerView("m", 2, 0, 2, 0, "bob", 700.0)  # swapped in: both serve
    await monitor.sample()
    assert killed == [(1, 500.0, 900.0)]  # the one using most
    killed.clear()
    views[1] = WorkerView("m", 2, 0, 2, 0, "bob", 700.0, loading=True)
    devices.used_mb = {1: 800.0, 2: 5.0, 3: 0.0}  # the loading one's kill would not do
    await monitor.sample()
    assert killed == [(1, 800.0, 805.0)]


async def test_over_its_tenant_s_quota_the_worker_that_grew_goes_not_the_largest() -> None:
    """Alice's quota leaves her workers without memory_mb 700 MB: her idle model of 400 MB
    and a model she shares with bob, whose large requests grew its worker from 56 to 350
    MB. The largest went: her idle model, killed again at each restart until it failed,
    while bob's requests all succeeded. The one that grew most past its size when it
    became ready goes; so too when bob's request came before the monitor's first look
    (the least size seen, the first rule, took that for the worker's usual size)."""
    devices = FakeDevices(used_mb={1: 400.0, 2: 350.0})
    views = [
        WorkerView("idle", 1, 0, 1, 0, "alice", 700.0, ready_mb=400.0),
        WorkerView("shared", 1, 0, 2, 0, "alice", 700.0, ready_mb=56.0),
    ]
    killed: list[tuple[int, float, float]] = []
    context = EngineContext(clock=FakeClock(), devices=devices)
    monitor = MemoryMonitor(
        lambda: views, lambda w, mb, all_mb: killed.append((w.pid, mb, all_mb)), context
    )
    await monitor.sample()  # its first look: bob's requests came before it
    assert killed == [(2, 350.0, 750.0)]
    killed.clear()
    devices.used_mb = {1: 520.0, 3: 230.0}  # the idle one grew; a new worker is at its start
    views[1] = WorkerView("shared", 1, 0, 3, 0, "alice", 700.0, ready_mb=230.0)
    await monitor.sample()
    assert killed == [(1, 520.0, 750.0)]


async def test_a_reservation_counts_what_the_tenant_s_workers_without_one_use(
    tmp_path: Path,
) -> None:
    """Bob's quota is 1,000 MB and his model without memory_mb uses 300: a model that
    reserves 800 was placed, leaving that model 200, and it was killed until it failed. It
    is refused, saying why. And a model.toml naming a tenant whose models in the profile do
    not include it is refused: mallory's model named bob and took his quota."""
    models = tmp_path / "models"
    make_scripted(models / "small" / "1" / "model.scripted", controls=())
    (models / "small" / "model.toml").write_text('tenant = "bob"\n')
    bob = Tenant("bob", memory_mb=1000, memory_enforced=True, models=("small", "big"))
    engine, context, devices, workers = engine_of(models, Tenant(DEFAULT_TENANT), bob)
    await engine.start()
    try:
        await eventually(lambda: engine.ready, what="the model to load")
        small_pid = engine.version("small").instances[0].pid
        assert small_pid is not None
        devices.used_mb = {small_pid: 300.0}
        await MemoryMonitor(engine.worker_views, engine.kill_over_memory, context).sample()
        mal = 'tenant = "bob"\nmemory_mb = 10\n'
        for name, toml in (("big", 'tenant = "bob"\nmemory_mb = 800\n'), ("mal", mal)):
            make_scripted(models / name / "1" / "model.scripted", controls=())
            (models / name / "model.toml").write_text(toml)
            await engine.load(name)
        failures = {name: engine.model_view(name).failures for name in ("big", "mal")}
        assert (
            "tenant 'bob' has 700 MB of its 1000 MB memory quota left (its models "
            "without a memory_mb use 300 MB)"
        ) in failures["big"][1]
        assert (
            "names tenant 'bob', whose models in the profile (small, big) do not include 'mal'"
        ) in failures["mal"][1]
        assert all(w.alive for w in workers.made)
    finally:
        await engine.stop()
