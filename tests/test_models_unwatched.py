"""A repository that events do not tell of, in-process (Engine and Registry on fake
workers): a model refused for want of room is synced again once room may be freed, ever
less often; and while the models folder cannot be watched (inotify's limits), every model
is looked at in turn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from infergate.clock import FakeClock
from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.lifecycle.registry import Registry
from infergate.engine.repository import watcher as watcher_module
from tests.fake_workers import FakeWorkers
from tests.full_disk import fill_the_disk
from tests.polling import eventually
from tests.scripted_runtime import make_scripted


@asynccontextmanager
async def serving_v1(models: Path, context: EngineContext) -> AsyncIterator[Engine]:
    """An engine on `models`, polled, once its model m's version 1 serves."""
    make_scripted(models / "m" / "1" / "model.scripted", controls=())
    engine = Engine(EngineSettings(models, "poll", stable_s=0.1), context)
    await engine.start()
    try:
        await eventually(lambda: engine.ready, what="version 1")
        yield engine
    finally:
        await engine.stop()


async def test_a_version_refused_for_want_of_room_loads_once_room_is_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new version refused for want of room for its copy waited for its folder to
    change, though room was freed 10 s later: no file event tells of it. The watcher
    syncs such a model again every ROOM_RETRY_S."""
    monkeypatch.setattr(watcher_module, "ROOM_RETRY_S", 0.2)
    models = tmp_path / "models"
    async with serving_v1(models, EngineContext(worker_factory=FakeWorkers())) as engine:
        full = fill_the_disk(monkeypatch)
        make_scripted(models / "m" / "2" / "model.scripted", controls=())
        await eventually(
            lambda: "MiB is kept free" in engine.registry.record("m").failures.get(2, ""),
            what="version 2 refused for want of room",
        )
        full[0] = False  # room freed: nothing in the folder changes
        await eventually(lambda: engine.version("m").version == 2, what="version 2 serving")
        assert engine.registry.record("m").failures == {}


async def test_models_reload_while_the_folder_cannot_be_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200,000 empty folders in one model's folder took every inotify watch: the watch
    failed, and no model was reloaded again (the gateway retried the watch every 8 s).
    While the folder cannot be watched, every model is looked at as a linked one is."""

    def no_watch(root: Path, handler: object) -> None:
        raise OSError(28, "inotify watch limit reached")

    monkeypatch.setattr(watcher_module, "watch_tree", no_watch)
    models = tmp_path / "models"
    context = EngineContext(worker_factory=FakeWorkers())
    async with serving_v1(models, context) as engine:
        assert context.metrics.registry.get_sample_value("infergate_repository_watching") == 0
        make_scripted(models / "m" / "2" / "model.scripted", controls=())
        await eventually(lambda: engine.version("m").version == 2, what="version 2 serving")
        make_scripted(models / "n" / "1" / "model.scripted", controls=())  # a new model
        registry = engine.registry
        await eventually(lambda: registry.has("n") and registry.record("n").state == "ready")


async def test_a_model_short_of_room_is_tried_again_ever_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each try for room is a failure event: a model refused every 10 s filled the event
    stream for good. The wait doubles after each refusal in a row (to 32 times), and a sync
    that finds room forgets it."""
    models = tmp_path / "models"
    make_scripted(models / "m" / "1" / "model.scripted", controls=())
    clock = FakeClock()
    registry = Registry(models, EngineContext(clock=clock, worker_factory=FakeWorkers()))
    full = fill_the_disk(monkeypatch)
    try:
        for wait_s in (10, 20, 40):
            await registry.sync("m")  # refused for want of room
            clock.advance(wait_s - 1)
            assert registry.short_of_room(10) == []
            clock.advance(1)
            assert registry.short_of_room(10) == ["m"]
            assert registry.short_of_room(10) == []  # named once
        full[0] = False
        await registry.sync("m")
        clock.advance(3600)
        assert registry.short_of_room(10) == []
    finally:
        await registry.stop()
