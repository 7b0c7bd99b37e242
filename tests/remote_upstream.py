"""A V2 upstream whose answers the test controls, for the remote runtime's tests.

A raw-asyncio HTTP/1.1 server on a free loopback port, run on its own thread and loop. It
serves one model's metadata, readiness and /v2/health/ready, and answers infer requests
as `mode` says: "ok" (a small JSON answer naming this upstream), "fail" (500), "busy"
(503), "close" (drops the connection without an answer), "one_shot" (answers, then closes
the connection without saying so, as a server's idle timeout does). `delay_s` holds each answer.
It records the sha256 of every infer body it got, with its Inference-Header-Content-Length
and Content-Type, so tests can show bodies arrive byte-identical.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from tests.server import free_port

METADATA_INPUTS = [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
METADATA_OUTPUTS = [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]


@dataclass(frozen=True)
class Received:
    sha256: str
    header_length: str | None
    content_type: str | None


@dataclass
class Upstream:
    model: str = "remote-mlp"
    mode: str = "ok"
    delay_s: float = 0.0
    ready: bool = True
    loading: bool = False  # the model's metadata is a 503, as a server still loading it says
    inputs: list[dict[str, Any]] = field(default_factory=lambda: list(METADATA_INPUTS))
    outputs: list[dict[str, Any]] = field(default_factory=lambda: list(METADATA_OUTPUTS))
    received: list[Received] = field(default_factory=list)
    health_checks: int = 0
    connections: int = 0  # accepted, ever
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Upstream:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self._loop
        )
        self._server = future.result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._handlers):  # those holding an answer (delay_s) too
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            for writer in list(self._writers):
                writer.close()
            if self._server is not None:
                await self._server.wait_closed()
            await asyncio.sleep(0)  # let the transports finish closing

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                answer = await self._answer(method, path, headers, body)
                if answer is None:
                    writer.close()
                    return
                writer.write(answer)
                await writer.drain()
                if self.mode == "one_shot":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
        finally:
            writer.close()
            self._writers.discard(writer)
            self._handlers.discard(task)

    async def _answer(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> bytes | None:
        base = f"/v2/models/{self.model}"
        if path == "/v2/health/ready":
            self.health_checks += 1
            return _reply(200 if self.ready else 503, {})
        if method == "GET" and path == base and self.loading:
            return _reply(503, {"error": f"model '{self.model}' is loading. Hint: retry shortly"})
        if method == "GET" and path == base:
            doc = {"name": self.model, "versions": ["1"], "platform": "scripted"}
            return _reply(200, {**doc, "inputs": self.inputs, "outputs": self.outputs})
        if method == "GET" and path == base + "/ready":
            return _reply(200 if self.ready else 400, {})
        if method == "POST" and path == base + "/infer":
            self.received.append(
                Received(
                    hashlib.sha256(body).hexdigest(),
                    headers.get("inference-header-content-length"),
                    headers.get("content-type"),
                )
            )
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.mode == "close":
                return None
            if self.mode == "fail":
                return _reply(500, {"error": "upstream model failed"})
            if self.mode == "busy":
                return _reply(503, {"error": "upstream busy"}, retry_after="2")
            answer: dict[str, Any] = {
                "model_name": self.model,
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
                "parameters": {"upstream": self.port},
            }
            return _reply(200, answer)
        return _reply(404, {"error": f"no route {method} {path}"})


def _reply(status: int, doc: dict[str, Any], retry_after: str | None = None) -> bytes:
    body = json.dumps(doc).encode()
    extra = f"Retry-After: {retry_after}\r\n" if retry_after else ""
    head = (
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
