"""Device isolation: placement within tenants' devices and quotas (pure, on the simulated
backend), and on real processes: a worker that outgrows its memory is killed and restarted
while everything else serves, repeated kills fail the model, a full quota refuses a load,
and simulated GPUs get workers placed with the right environment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infergate.engine.admission.tenants import Tenant
from infergate.engine.placement.devices import SimulatedGpuBackend
from infergate.engine.placement.placer import PlacementRefused, Placer
from tests.conftest import write_profile
from tests.onnx_models import make_mlp
from tests.polling import wait_until
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


def test_placement_picks_the_most_free_device_the_tenant_may_use() -> None:
    placer = Placer(SimulatedGpuBackend([2000, 1000]))
    anyone = Tenant("a", memory_mb=10_000)
    first = placer.place("m", anyone, "auto", 600)
    assert first.device == "sim:0"
    assert dict(first.placement.env) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert first.placement.runtime_device == "cpu"  # simulated: the worker really runs on the CPU
    assert placer.place("m", anyone, "auto", 600).device == "sim:0"  # 1400 > 1000
    assert placer.place("m", anyone, "auto", 600).device == "sim:1"  # 800 < 1000
    only_one = Tenant("b", devices=("sim:1",), memory_mb=10_000)
    assert placer.place("n", only_one, "auto", 300).device == "sim:1"
    with pytest.raises(PlacementRefused, match=r"no device tenant 'b' may use has 500 MB free"):
        placer.place("n", only_one, "auto", 500)
    cpu = placer.place("c", anyone, "cpu", None).placement
    assert cpu.device == "cpu"
    assert dict(cpu.env) == {"CUDA_VISIBLE_DEVICES": ""}
    first.release()
    assert placer.reserved(device="sim:0") == 600
    first.release()  # twice: still only its own
    assert placer.reserved(device="sim:0") == 600


def test_cpu_workers_get_their_share_of_the_cores() -> None:
    placer = Placer(SimulatedGpuBackend([1000]), cores=4)
    anyone = Tenant("a")
    first = placer.place("a", anyone, "cpu", None).placement
    assert (first.threads, first.cpus) == (4, (0, 1, 2, 3))  # alone: all of them
    second = placer.place("b", anyone, "cpu", None).placement
    assert (second.threads, second.cpus) == (2, (0, 1))  # two workers: half each
    third = placer.place("c", anyone, "cpu", None).placement
    assert (third.threads, third.cpus) == (1, (2,))  # round-robin over the cores
    pinned = placer.place("d", anyone, "cpu", None, threads=3).placement
    assert (pinned.threads, pinned.cpus) == (3, (0, 1, 3))  # model.toml's threads win
    gpu = placer.place("e", anyone, "auto", None).placement
    assert (gpu.threads, gpu.cpus) == (None, None)  # GPU workers: the runtime's choice


def test_a_full_tenant_quota_refuses_with_the_numbers() -> None:
    placer = Placer(SimulatedGpuBackend([8000]))
    team = Tenant("team", memory_mb=1000)
    placer.place("a", team, "auto", 700)
    with pytest.raises(PlacementRefused) as refused:
        placer.place("b", team, "auto", 500)
    message = str(refused.value)
    assert "tenant 'team' has 300 MB of its 1000 MB memory quota left" in message
    assert "model 'b' needs 500 MB" in message


HOG_PROFILE = """
[devices]
monitor_interval_s = 0.1
max_kills = 2
kill_window_s = 60
"""


@pytest.fixture
def hog_server(tmp_path: Path) -> Iterator[ServerProcess]:
    models = tmp_path / "models"
    (tmp_path / "gates").mkdir()
    hog = models / "hog" / "1" / "model.scripted"
    make_scripted(hog, ("alloc_mb", "hold"), gate_dir=tmp_path / "gates")
    (models / "hog" / "model.toml").write_text("memory_mb = 300\n")
    make_mlp(models / "mlp" / "1" / "model.onnx")
    proc = ServerProcess(models, write_profile(tmp_path, HOG_PROFILE), tmp_path / "server.log")
    yield proc.start()
    proc.stop()


def hog(mb: int, hold: int = 0) -> dict[str, Any]:
    """Allocate `mb` for the call; with `hold`, keep it until released (never, here)."""
    return scripted_inputs(alloc_mb=mb, hold=hold)


def mlp_ok(server: ServerProcess) -> bool:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    return httpx.post(f"{server.url}/v2/models/mlp/infer", json=body).status_code == 200


def test_a_worker_over_its_memory_is_killed_and_restarted(hog_server: ServerProcess) -> None:
    url = f"{hog_server.url}/v2/models/hog/infer"
    assert httpx.post(url, json=hog(10)).status_code == 200  # small: fine
    old = hog_server.worker_pids("hog")
    response = httpx.post(url, json=hog(400, hold=1), timeout=60)  # held until killed
    assert response.status_code == 503
    error = response.json()["error"]
    assert "over its memory limit of 300 MB" in error
    assert "it used" in error
    assert mlp_ok(hog_server)  # the gateway and the other model kept serving
    model = hog_server.wait_model_state("hog", "ready")
    instance = model["versions"][0]["instances"][0]
    assert instance["restarts"] == 1
    assert instance["memory_limit_mb"] == 300
    assert [instance["pid"]] != old
    assert httpx.post(url, json=hog(10)).status_code == 200
    # A second kill within the window (max_kills = 2), again while a request ran: that
    # request's doing, not the model's own growth (which max_kills judges, see
    # test_timing_rules), so the model restarts and serves: a tenant's requests cannot
    # fail it for every tenant (tests/test_tenant_isolation.py).
    assert httpx.post(url, json=hog(400, hold=1), timeout=60).status_code == 503
    hog_server.wait_model_state("hog", "ready")
    assert httpx.post(url, json=hog(10)).status_code == 200
    assert mlp_ok(hog_server)


def test_each_holder_releases_only_its_own_reservation() -> None:
    placer = Placer(SimulatedGpuBackend([8000]))
    team = Tenant("team", memory_mb=1000)
    old = placer.place("a", team, "auto", 400)
    new = placer.place("a", team, "auto", 400)  # the same model again: a second holder
    old.release()
    assert placer.reserved(tenant="team") == 400
    new.release()
    assert placer.reserved(tenant="team") == 0


QUOTA_PROFILE = """
[tenants.default]
rps = 100000
burst = 100000
[tenants.quota]
memory_mb = 1000
[tenants.reloads]
memory_mb = 1300
"""


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two tenants with memory quotas, one per test: `quota` owns a and b (600 MB each,
    for 1000 MB), `reloads` owns r (600 MB, for 1300 MB)."""
    root = tmp_path_factory.mktemp("quota")
    models = root / "models"
    for name, tenant in (("a", "quota"), ("b", "quota"), ("r", "reloads")):
        make_scripted(models / name / "1" / "model.scripted", ())
        (models / name / "model.toml").write_text(f'memory_mb = 600\ntenant = "{tenant}"\n')
    server = ServerProcess(models, write_profile(root, QUOTA_PROFILE), root / "server.log")
    yield server.start()
    server.stop()


def test_a_load_past_the_tenant_quota_is_refused(quota_server: ServerProcess) -> None:
    server = quota_server
    states = {m: server.model(m) for m in ("a", "b")}
    assert sorted(s["state"] for s in states.values()) == ["failed", "ready"]
    refused = next(s for s in states.values() if s["state"] == "failed")
    assert "tenant 'quota' has 400 MB of its 1000 MB memory quota left" in refused["reason"]
    load = httpx.post(f"{server.url}/v2/repository/models/{refused['name']}/load")
    assert load.status_code == 400
    assert "memory quota" in load.json()["error"]
    ready = next(s for s in states.values() if s["state"] == "ready")
    assert (
        httpx.post(f"{server.url}/v2/repository/models/{ready['name']}/unload").status_code == 200
    )
    assert (
        httpx.post(f"{server.url}/v2/repository/models/{refused['name']}/load").status_code == 200
    )  # the quota freed up


SIM_PROFILE = """
[devices]
backend = "simulated"
simulated_mb = [2000, 1000]
monitor_interval_s = 0.1
max_kills = 2
[tenants.default]
rps = 100000
burst = 100000
[tenants.teamb]
devices = ["sim:1"]
"""


def test_simulated_gpus_placement_environment_and_kills(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for name, toml in (
        ("big", "memory_mb = 900\ninstances = 2\n"),
        ("small", 'memory_mb = 400\ntenant = "teamb"\n'),
        ("tight", "memory_mb = 20\n"),
    ):  # tight: less than any worker's RSS. Scripted workers start fast (no onnxruntime),
        # and each big one holds 40 MB from loading on.
        make_scripted(models / name / "1" / "model.scripted", (), load_alloc_mb=40)
        (models / name / "model.toml").write_text(toml)
    server = ServerProcess(
        models, write_profile(tmp_path, SIM_PROFILE), tmp_path / "server.log"
    ).start()
    try:
        big = server.model("big")["versions"][0]["instances"]
        assert [i["placed_on"] for i in big] == ["sim:0", "sim:0"]
        assert [i["visible_devices"] for i in big] == ["0", "0"]
        small = server.model("small")["versions"][0]["instances"][0]
        assert small["placed_on"] == "sim:1"
        assert small["visible_devices"] == "1"
        failed = server.wait_model_state("tight", "failed", timeout_s=60)
        assert "over its memory limit of 20 MB" in failed["reason"]
        stats = httpx.get(f"{server.url}/admin/stats").json()
        assert stats["backend"] == "simulated"
        devices = {d["name"]: d for d in stats["devices"]}
        wait_until(
            lambda: (
                httpx.get(f"{server.url}/admin/stats").json()["devices"][0]["memory_used_mb"] > 50
            ),
            what="sim:0 to show its workers' memory",
        )
        assert devices["sim:1"]["memory_total_mb"] == 1000
    finally:
        server.stop()


def test_reloading_an_unchanged_model_keeps_its_reservation(quota_server: ServerProcess) -> None:
    """The old version's stop releases the old version's reservation, not the new one's:
    after the reload the quota still counts the model, so a second one does not fit.
    (During the reload both versions' workers run, and both count: hence 1300 MB.)"""
    server = quota_server
    assert server.wait_model_state("r", "ready")
    reload = httpx.post(f"{server.url}/v2/repository/models/r/load", timeout=60)
    assert reload.status_code == 200

    def stats() -> dict[str, Any]:
        return httpx.get(f"{server.url}/admin/stats").json()  # type: ignore[no-any-return]

    wait_until(
        lambda: any(
            e["kind"] == "model_version_stopped" and e["model"] == "r" for e in stats()["events"]
        ),
        what="the replaced version of r to stop",
    )
    tenant = next(t for t in stats()["tenants"] if t["name"] == "reloads")
    assert tenant["reserved_mb"] == 600
    make_scripted(server.models / "r2" / "1" / "model.scripted", ())
    (server.models / "r2" / "model.toml").write_text('memory_mb = 800\ntenant = "reloads"\n')
    load = httpx.post(f"{server.url}/v2/repository/models/r2/load", timeout=60)
    assert load.status_code == 400
    error = load.json()["error"]
    assert "tenant 'reloads' has 700 MB of its 1300 MB memory quota left" in error
