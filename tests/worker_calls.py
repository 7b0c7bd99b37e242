"""Small helpers for tests that drive real workers: one request in a thread, and an
instance's worker pid."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from tests.server import ServerProcess


class Background:
    """One request in a thread."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, args=(url, body))
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        self.response = httpx.post(url, json=body, timeout=60)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> httpx.Response:
        self._thread.join(60)
        assert self.response is not None
        return self.response


def instance_pid(server: ServerProcess, model: str, index: int) -> int:
    instances = server.model(model)["versions"][0]["instances"]
    pid = instances[index]["pid"]
    assert pid is not None
    return int(pid)
