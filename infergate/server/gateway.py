"""The composition root: a profile and a model folder in, the engine and its ASGI app out.

`infergate serve`, the benchmarks and in-process tests (httpx's ASGITransport) all build
the gateway here, so the wiring (device backend, verification keys, tenants, engine, the
live profile store, the app) is written once. What only a listening server needs (the
socket, uvicorn, the drain on SIGTERM, the connection limits) stays in cli/serve.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from starlette.types import ASGIApp

from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.placement.devices import choose_backend
from infergate.engine.repository.verify import VerifyPolicy, load_public_key
from infergate.engine.workers.handle import WorkerHandle
from infergate.engine.workers.protocol import WorkerFactory
from infergate.errors import ConfigError
from infergate.profile import Profile
from infergate.profile_store import ProfileStore
from infergate.server.app import create_app
from infergate.server.drain import Drain
from infergate.server.infer_route import InferRoute


class Gateway(NamedTuple):
    engine: Engine
    app: ASGIApp
    route: InferRoute  # the app's infer route, for the HTTP protocol's lane (infer_lane.py)


def private_models_without_admin_keys(fix: str) -> str:
    """Why `private_models` without `admin_keys` does not start, and `fix`, the command
    that adds an admin key to the profile."""
    return (
        "server.private_models is set but server.admin_keys is empty: without admin keys "
        f"every caller counts as an operator and sees every model. Fix: {fix} (adds an "
        "admin key's hash to the profile), or leave private_models off"
    )


def build_gateway(
    profile: Profile,
    models_dir: Path,
    profile_path: Path | None = None,
    worker_factory: WorkerFactory = WorkerHandle,
    drain: Drain | None = None,
) -> Gateway:
    """Wire the engine and the app for `profile`, serving `models_dir`. `profile_path` is
    where admin changes persist and live edits are read (default: the file the profile
    came from; None there too: changes live in memory only). The app's lifespan starts
    and stops the engine; a caller that skips the lifespan (the ASGI transport, a
    benchmark) calls `engine.start()` and `engine.stop()` itself.

    With `drain` (cli/serve.py's), the app drains on its signal inside the access log
    (server/drain.py), so a drain's 503 carries a request id and a log line.

    Raises ConfigError for what the profile asks and this machine cannot give (a trusted
    key that does not read, an NVML backend that does not answer)."""
    settings = profile.server
    if settings.private_models and not settings.admin_keys:
        raise ConfigError(private_models_without_admin_keys("infergate key new --admin --write"))
    keys = tuple(load_public_key(k) for k in settings.trusted_keys)
    devices = profile.devices
    try:
        backend = choose_backend(devices.backend, list(devices.simulated_mb))
    except Exception as exc:  # the profile asked for NVML and it is not there
        raise ConfigError(
            f'devices.backend = "nvml" but NVML does not answer: {exc}. Hint: install the '
            'gpu extra (./install.sh on a machine where nvidia-smi works) or use "auto"'
        ) from exc
    context = EngineContext(
        verify=VerifyPolicy(settings.require_signed_models, keys),
        load_timeout_s=settings.load_timeout_s,
        drain_timeout_s=settings.drain_timeout_s,
        devices=backend,
        monitor_interval_s=devices.monitor_interval_s,
        max_kills=devices.max_kills,
        kill_window_s=devices.kill_window_s,
        worker_nice=devices.worker_nice,
        worker_factory=worker_factory,
        max_concurrent_loads=settings.max_concurrent_loads,
        settings=profile.live_settings(),
    )
    if profile.cluster.enabled:  # read at start: a new redis_url needs a restart
        from infergate.engine.cluster.metrics import ClusterMetrics
        from infergate.engine.cluster.redis_limits import SharedLimits

        context.shared_limits = SharedLimits(
            profile.cluster,
            context.tenants,
            ClusterMetrics(context.metrics.registry),
            context.clock,
        )
    engine_settings = EngineSettings(
        models_dir=models_dir,
        model_control="explicit" if settings.model_control == "explicit" else "poll",
        stable_s=settings.file_stable_s,
    )
    engine = Engine(engine_settings, context)
    store = ProfileStore(profile_path or profile.source, profile, engine)
    app, route = create_app(engine, int(settings.max_request_mb * 2**20), store, drain)
    return Gateway(engine, app, route)
