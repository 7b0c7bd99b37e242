"""A version's failure row, in-process (Registry on fake workers): a bad edit of a serving
model shows as a failure beside the version that keeps serving, and goes once the files
are what serves again."""

from __future__ import annotations

from pathlib import Path

from infergate.engine.context import EngineContext
from infergate.engine.lifecycle.registry import Registry
from tests.fake_workers import FakeWorkers
from tests.scripted_runtime import make_scripted


async def test_a_bad_edit_undone_leaves_no_failure_behind(tmp_path: Path) -> None:
    """A model.toml edit that failed to load, then undone: "failed" showed in `model list`
    until someone loaded the model by hand, though what is on disk was what served."""
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=())
    toml = tmp_path / "models" / "m" / "model.toml"
    toml.write_text("timeout_ms = 5000\n")
    registry = Registry(tmp_path / "models", EngineContext(worker_factory=FakeWorkers()))
    try:
        await registry.sync("m")
        serving = registry.record("m").versions[1]
        toml.write_text('timeout_ms = 5000\ntenant = "nobody"\n')  # no such tenant
        await registry.sync("m")
        assert "names tenant 'nobody'" in registry.record("m").failures[1]
        assert registry.record("m").versions[1] is serving
        assert "keeps serving" in str(registry.record("m").reason)
        toml.write_text("timeout_ms = 5000\n")  # undone
        await registry.sync("m")
        assert registry.record("m").failures == {}
        assert registry.record("m").versions[1] is serving
        assert registry.record("m").reason is None
    finally:
        await registry.stop()
