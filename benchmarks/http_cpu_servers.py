"""The servers `benchmarks/http_cpu.py` measures beside infergate's own: granian serving
the gateway's app (`--granian DIR`), and the bare HTTP servers that answer a fixed body
without a gateway (`--bare`: uvicorn with the gateway's protocol, a raw httptools
Protocol, granian's ASGI and RSGI), each started on a free port and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server import free_port, wait_ready  # noqa: E402

# Run by granian's worker (`--granian`): the gateway's ASGI app built from the environment.
GRANIAN_APP = """
import os
from pathlib import Path
from infergate.profile import load_profile
from infergate.server.gateway import build_gateway

def app():
    profile = Path(os.environ["HTTP_CPU_PROFILE"])
    return build_gateway(load_profile(profile), Path(os.environ["HTTP_CPU_MODELS"])).app
"""


# `--bare`: the servers' own cost, each answering with the tiny model's answer as it is.
BARE_APPS = """
BODY = (b'{"model_name":"tiny","model_version":"1","outputs":[{"name":"y","datatype":"FP32",'
        b'"shape":[1,10],"data":[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0]}]}')
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]

async def asgi(scope, receive, send):
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})

async def rsgi(scope, protocol):
    await protocol()
    protocol.response_bytes(200, [("content-type", "application/json")], BODY)

# The floor under any ASGI server in Python: httptools' parser in an asyncio Protocol that
# answers each request from its parser callback, without a task, a scope or a message.
RAW_ANSWER = (
    b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n"
    % len(BODY) + BODY
)

def raw(port):
    import asyncio, httptools, uvloop

    class Raw(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data):
            self.parser.feed_data(data)

        def on_message_complete(self):
            self.transport.write(RAW_ANSWER)

    async def main():
        server = await asyncio.get_running_loop().create_server(Raw, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())
"""


def launch(
    work: Path, name: str, command: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server on a free port (`{port}` in the command); its process and URL."""
    port = free_port()
    log = work / f"{name}.log"
    process = subprocess.Popen(
        [a.replace("{port}", str(port)) for a in command],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, log)
    return process, url


def granian_command(interface: str, target: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "granian",
        "--interface",
        interface,
        *(["--factory"] if target.endswith(":app") else []),
        "--workers",
        "1",
        "--loop",
        "uvloop",
        "--http",
        "1",
        "--no-ws",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        target,
    ]


def start_granian(
    work: Path, models: Path, profile: Path, granian: Path
) -> tuple[subprocess.Popen[bytes], str]:
    (work / "http_cpu_granian_app.py").write_text(GRANIAN_APP)
    env = {
        "PYTHONPATH": os.pathsep.join([str(work), str(ROOT), str(granian)]),
        "HTTP_CPU_PROFILE": str(profile),
        "HTTP_CPU_MODELS": str(models),
    }
    return launch(work, "granian", granian_command("asgi", "http_cpu_granian_app:app"), env)


def start_bare(work: Path, granian: Path | None) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
    """The HTTP servers alone, each answering every request with a fixed body the size of
    the tiny model's answer: uvicorn with the gateway's protocol, a bare httptools
    Protocol (no ASGI: the floor), and granian's ASGI and RSGI when given."""
    (work / "http_cpu_bare.py").write_text(BARE_APPS)
    env = {
        "PYTHONPATH": os.pathsep.join([str(work), str(ROOT), *([str(granian)] if granian else [])])
    }
    uvicorn_run = (
        "import uvicorn, http_cpu_bare; "
        "from infergate.server.http_protocol import GatewayHttpProtocol; "
        "uvicorn.run(http_cpu_bare.asgi, host='127.0.0.1', port={port}, loop='uvloop', "
        "http=GatewayHttpProtocol, lifespan='off', access_log=False, server_header=False, "
        "proxy_headers=False, log_level='warning')"
    )
    raw_run = "import http_cpu_bare; http_cpu_bare.raw({port})"
    servers = {
        "uvicorn-bare": launch(work, "uvicorn-bare", [sys.executable, "-c", uvicorn_run], env),
        "raw-bare": launch(work, "raw-bare", [sys.executable, "-c", raw_run], env),
    }
    if granian:
        for interface in ("asgi", "rsgi"):
            command = granian_command(interface, f"http_cpu_bare:{interface}")
            servers[f"granian-{interface}-bare"] = launch(work, interface, command, env)
    return servers


def stop_granian(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
