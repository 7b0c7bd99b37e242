"""The remote runtime's rules on an injected clock, in-process: outlier ejection (Envoy's
meanings), health thresholds, least-request choice, retries and their budget."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from infergate.clock import FakeClock
from infergate.engine.remote.balancer import Balancer, RetryBudget
from infergate.engine.remote.client import RemotePool, UpstreamReply, answered, passed_on
from infergate.engine.remote.config import RemoteConfig
from infergate.engine.remote.health import HealthChecks
from infergate.engine.remote.http1 import Payload, Reply
from infergate.engine.remote.outlier import OutlierDetector, OutlierPolicy
from infergate.engine.remote.served import verified_config
from infergate.engine.remote.slots import Turn
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
    ConfigError,
    ConnectFailed,
    QueueDeadlineExceeded,
    UpstreamAnswered,
    UpstreamFailed,
)

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
