"""`infergate serve`: start the gateway."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
import math
import resource
import shlex
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from infergate.cli.common import EXIT_FAILURE, EXIT_USAGE, check_models_folder, fail
from infergate.cli.logs import configure as configure_logging
from infergate.errors import ConfigError

if TYPE_CHECKING:  # uvicorn and the server load once the options are checked
    import uvicorn

    from infergate.server.drain import Drain, DrainingServer


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    models: Annotated[
        Path | None,
        typer.Option(
            envvar="INFERGATE_MODELS",
            help="Model repository [default: the profile's server.models, else models/]",
        ),
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(
            envvar="INFERGATE_PROFILE",
            help="Profile TOML [default: profiles/default.toml when present]",
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            envvar="INFERGATE_HOST",
            help="Address to bind [default: the profile's, else 127.0.0.1]",
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            envvar="INFERGATE_PORT",
            help="Port, 0-65535 (0: any free one) [default: the profile's, else 8000]",
        ),
    ] = None,
    log_level: Annotated[
        str,
        typer.Option(
            envvar="INFERGATE_LOG_LEVEL",
            help="debug, info, warning, error or critical",
        ),
    ] = "info",
    log_format: Annotated[
        str, typer.Option(help="text, or json: one JSON object a line, for log collectors")
    ] = "text",
    access_log: Annotated[
        bool,
        typer.Option(help="Log every request: status, latency, model, tenant, request id"),
    ] = False,
) -> None:
    """Serve every model in the repository over the KServe V2 protocol."""
    from infergate.cli.logs import FORMATS, LEVELS

    if log_level.lower() not in LEVELS:
        fail(f"--log-level {log_level!r}: expected one of {', '.join(LEVELS)}", EXIT_USAGE)
    if log_format not in FORMATS:
        fail(f"--log-format {log_format!r}: expected text or json", EXIT_USAGE)
    log_level = log_level.lower()
    from infergate.profile import DEFAULT_PROFILE, load_profile

    try:
        loaded = load_profile(profile)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    settings = loaded.server
    models_dir = models or settings.models
    bind = host or settings.host
    # --models (or INFERGATE_MODELS), else the profile's server.models, else models/
    check_models_folder(
        models_dir, "server.models" if models is None and loaded.source else "--models"
    )
    if not models_dir.is_dir():
        where = "" if models_dir.is_absolute() else f" (in {Path.cwd()})"
        found = "" if loaded.source else f"; no profile was found at {DEFAULT_PROFILE}"
        fail(
            f"models folder {models_dir}{where} does not exist{found}; create it, pass "
            "--models DIR, or run serve from your project's folder",
            EXIT_USAGE,
        )
    if not is_loopback(bind) and not settings.admin_keys:
        fail(
            f"refusing to serve on {bind}, which is not a loopback address, with no admin "
            "keys: anyone who can reach it could load, unload and reconfigure models. Fix: "
            f"{_admin_key_command(loaded.source)} (adds an admin key's hash to "
            f"{loaded.source or DEFAULT_PROFILE}; the same with --tenant NAME for a tenant's "
            "key), or bind 127.0.0.1",
            EXIT_USAGE,
        )
    if settings.private_models and not settings.admin_keys:
        from infergate.server.gateway import private_models_without_admin_keys

        fail(private_models_without_admin_keys(_admin_key_command(loaded.source)), EXIT_USAGE)
    bind_port = settings.port if port is None else port
    if not 0 <= bind_port <= 65535:  # 0: any free port (the listening line names it)
        fail(f"port {bind_port} is out of range: give one from 0 to 65535", EXIT_USAGE)
    # Before any worker starts: a clash leaves nothing behind. Fronts share the port.
    sock = _bind(bind, bind_port, shared=settings.fronts > 0)
    configure_logging(log_level, log_format, access_log)

    import uvicorn

    from infergate.server.drain import Drain
    from infergate.server.gateway import build_gateway
    from infergate.server.http_protocol import ConnectionLimits, GatewayHttpProtocol
    from infergate.server.infer_lane import InferLane

    drain = Drain()
    source = loaded.source or (profile or DEFAULT_PROFILE)
    try:
        gateway = build_gateway(loaded, models_dir, source, drain=drain)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    lane = InferLane(gateway.route, drain)
    limits = ConnectionLimits(
        max_header_bytes=int(settings.max_header_kb * 1024),
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        keep_alive_timeout_s=settings.keep_alive_timeout_s,
        max_connections=connection_cap(settings.max_connections),
        max_connections_per_client=settings.max_connections_per_client,
    )
    if settings.fronts:
        from infergate.server.fronts import serve_with_fronts

        _tune_gc()
        code = serve_with_fronts(
            settings.fronts,
            gateway.app,
            gateway.route,
            drain,
            settings.drain_timeout_s,
            sock,
            listen_url(sock),
            limits,
            int(settings.max_request_mb * 2**20),
            log_level,
            log_format,
            access_log,
        )
        if code:
            raise typer.Exit(code)
        return
    config = uvicorn.Config(
        gateway.app,
        host=bind,
        port=bind_port,
        log_level=log_level,
        log_config=None,  # our handler and format (text or JSON) for uvicorn's loggers too
        http=GatewayHttpProtocol.with_limits(limits, lane),
        ws="none",  # no WebSockets: an Upgrade is ignored (server/http_protocol.py)
        proxy_headers=False,  # no proxy in front by default; saves work on every request
        server_header=False,  # one header less to check and send on every response
        access_log=False,  # server/access_log.py writes a richer line
        timeout_keep_alive=max(1, math.ceil(settings.keep_alive_timeout_s)),  # (ours: exact)
        # The drain has waited for requests already; this is for what is left after it
        # (an event stream, a request past the drain time, answered 503 when cancelled).
        timeout_graceful_shutdown=1,
    )
    server = _announcing_server(config, drain, settings.drain_timeout_s, listen_url(sock))
    _tune_gc()
    server.run(sockets=[sock])
    if not server.started:
        raise typer.Exit(1)


def _admin_key_command(source: Path | None) -> str:
    """The command that adds an admin key to the profile serve reads: `source`, else the
    default profile, which `key new --write` creates (in a folder that exists)."""
    from infergate.profile import DEFAULT_PROFILE

    command = "infergate key new --admin --write"
    if source is not None and source != DEFAULT_PROFILE:
        return f"{command} --profile {shlex.quote(str(source))}"
    if not DEFAULT_PROFILE.parent.is_dir():
        return f"mkdir {DEFAULT_PROFILE.parent} && {command}"
    return command


def listen_url(sock: socket.socket) -> str:
    """The address a socket is bound to, as a URL (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _announcing_server(
    config: uvicorn.Config, drain: Drain, drain_timeout_s: float, url: str
) -> DrainingServer:
    """The server, logging where it listens once it accepts connections: uvicorn says so
    only when it binds the socket itself, and serve binds it (see _bind)."""
    from infergate.server.drain import DrainingServer

    class Announcing(DrainingServer):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                logging.getLogger("infergate.server").info("listening on %s", url)

    return Announcing(config, drain, drain_timeout_s)


def _bind(host: str, port: int, shared: bool = False) -> socket.socket:
    """The listening socket, bound here so that a port in use is one clear line. `shared`
    (front processes): the fronts bind the same port beside it (SO_REUSEPORT), which is
    set once it is bound, so that another program (another gateway with fronts too)
    cannot share the port with us."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        fail(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}. Hint: another server "
            "holds the port; stop it, or pass --port (or set INFERGATE_PORT)",
            EXIT_FAILURE,
        )
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.set_inheritable(True)
    return sock


# Descriptors kept for the gateway's own use beyond client connections: workers' pipes and
# shared memory, model files, the repository watcher, logs.
_FD_RESERVE = 256


def connection_cap(wanted: int) -> int:
    """`max_connections`, raising the open-file limit to fit it (as nginx's
    worker_rlimit_nofile does) or, where the hard limit is too low, lowering the cap so
    that the gateway keeps descriptors for its own work whatever clients do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, soft - _FD_RESERVE)
        logging.getLogger("infergate.server").warning(
            "max_connections = %d does not fit the open-file limit (%d); using %d. Hint: "
            "raise the limit (ulimit -n) or lower max_connections",
            wanted,
            soft,
            cap,
        )
        return cap
    return wanted


def _tune_gc() -> None:
    """Every request allocates a few hundred objects, so with Python's default thresholds
    the cyclic collector runs every few requests and now and then walks every object the
    gateway has: about 8% of its CPU at a few thousand requests/s. Freezing what startup
    built takes those objects out of every walk, and a larger first threshold makes the
    young collections rare; cycles (error paths, tracebacks) are still collected, a little
    later (the oldest generation about every ten million allocations)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)
