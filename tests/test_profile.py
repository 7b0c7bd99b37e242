"""The profile: defaults, every section read, and mistakes named with file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.errors import ConfigError
from infergate.profile import load_profile
from infergate.profile_store import ProfileStore

REPO = Path(__file__).resolve().parent.parent


def test_the_shipped_profile_loads() -> None:
    profile = load_profile(REPO / "profiles" / "default.toml")
    assert profile.server.port == 8000
    assert profile.server.models == REPO / "models"
    assert profile.batching.max_batch_size == 32
    assert [c.name for c in profile.classes] == ["realtime", "burst", "batch"]
    assert profile.default_class == "burst"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nport = 'eighty'", "server.port: expected an integer, got 'eighty'"),
        ("[server]\nprot = 80", "unknown key server.prot"),
        ("[servers]\nport = 80", "unknown key servers"),
        ("[server]\nmodel_control = 'manual'", "expected one of poll, explicit"),
        ("[server]\nrequire_signed_models = true", "trusted_keys is empty"),
        ("[server]\ntrusted_keys = ['nope.pub']", "nope.pub does not exist"),
        ("[batching]\nmax_batch_size = -1", "batching.max_batch_size: expected an integer >= 0"),
        ("[batching]\nmax_delay_ms = 2", "unknown key batching.max_delay_ms"),
        ("[classes.fast]\nrank = 0", "classes.fast.: each class needs rank and deadline_ms"),
        ("[tenants.default]\nclass = 'gold'", "'gold' is not a class"),
        ("[server\nport = 1", "not valid TOML"),
        ("[devices]\nworker_nice = 20", "devices.worker_nice: expected an integer from 0 to 19"),
        ("[devices]\nworker_nice = -5", "devices.worker_nice: expected an integer from 0 to 19"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "profile.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_profile(path)
    assert str(path) in str(caught.value)
    assert message in str(caught.value)


def test_custom_classes_and_batching(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        "[batching]\nmax_queue_delay_ms = 5\n"
        "[classes.gold]\nrank = 0\ndeadline_ms = 10\n"
        "[classes.bronze]\nrank = 1\ndeadline_ms = 1000\n"
        "[tenants.default]\nclass = 'bronze'\nrps = 10\n"
    )
    profile = load_profile(path)
    assert profile.batching.max_delay_s == 0.005
    assert {c.name: c.deadline_s for c in profile.classes} == {"gold": 0.01, "bronze": 1.0}
    assert profile.default_class == "bronze"


def test_worker_nice_is_read_and_a_devices_change_says_it_needs_a_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "profile.toml"
    path.write_text("[devices]\nworker_nice = 0\n")
    profile = load_profile(path)
    assert profile.devices.worker_nice == 0
    assert load_profile(None).devices.worker_nice == 10
    engine = Engine(EngineSettings(models_dir=tmp_path), EngineContext())
    store = ProfileStore(path, profile, engine)
    path.write_text("[devices]\nworker_nice = 5\n")
    assert store.reload()
    messages = [e.message for e in engine.context.events.recent() if e.kind.endswith("needed")]
    assert messages == [
        "[devices] worker_nice changed; it applies at the next start (infergate serve)"
    ]
