"""`infergate serve`: start the gateway."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from infergate.cli.common import EXIT_USAGE, fail
from infergate.errors import ConfigError


def serve(
    models: Annotated[Path | None, typer.Option(help="Model repository [default: models/]")] = None,
    profile: Annotated[
        Path | None, typer.Option(help="Profile TOML [default: profiles/default.toml when present]")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind [default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="Port [default: 8000]")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request")] = False,
) -> None:
    """Serve every model in the repository over the KServe V2 protocol."""
    from infergate.profile import load_profile

    try:
        loaded = load_profile(profile)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    settings = loaded.server
    models_dir = models or settings.models
    if not models_dir.is_dir():
        fail(
            f"models folder {models_dir} does not exist; create it or pass --models DIR", EXIT_USAGE
        )
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s"
    )

    import uvicorn

    from infergate.engine.context import EngineContext
    from infergate.engine.engine import Engine, EngineSettings
    from infergate.engine.scheduling.classes import ClassTable
    from infergate.engine.verify import VerifyPolicy, load_public_key
    from infergate.server.app import create_app

    try:
        keys = tuple(load_public_key(k) for k in settings.trusted_keys)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    context = EngineContext(
        classes=ClassTable(loaded.classes),
        default_class=loaded.default_class,
        queue_policy=loaded.batching,
        verify=VerifyPolicy(settings.require_signed_models, keys),
        load_timeout_s=settings.load_timeout_s,
        drain_timeout_s=settings.drain_timeout_s,
    )
    engine_settings = EngineSettings(
        models_dir=models_dir,
        model_control="explicit" if settings.model_control == "explicit" else "poll",
        stable_s=settings.file_stable_s,
    )
    engine = Engine(engine_settings, context)
    app = create_app(engine, int(settings.max_request_mb * 2**20))
    config = uvicorn.Config(
        app,
        host=host or settings.host,
        port=settings.port if port is None else port,
        log_level=log_level,
        proxy_headers=False,  # no proxy in front by default; saves work on every request
        access_log=access_log,
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        raise typer.Exit(1)
