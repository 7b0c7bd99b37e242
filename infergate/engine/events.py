"""The event stream: reloads, failures, restarts and kills, for the log, the dashboard
and `/admin/events`. Subscribers get a bounded queue; a slow one loses old events rather
than slowing the engine down."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("infergate.events")


@dataclass(frozen=True)
class Event:
    kind: str  # e.g. model_ready, model_load_failed, model_unloaded, worker_restarted
    model: str
    message: str
    version: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    id: int = 0
    time: float = 0.0  # wall-clock seconds, for people reading the stream

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class EventBus:
    def __init__(self, keep: int = 500, queue_size: int = 1000) -> None:
        self._recent: deque[Event] = deque(maxlen=keep)
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self._ids = itertools.count(1)
        self._queue_size = queue_size

    def publish(
        self, kind: str, model: str, message: str, version: int | None = None, **data: Any
    ) -> Event:
        event = Event(kind, model, message, version, data, next(self._ids), time.time())
        self._recent.append(event)
        level = logging.WARNING if "fail" in kind or "kill" in kind else logging.INFO
        # The kind first in the args (cli/logs.py's EventLevels reads it); JSON logs get the
        # fields as keys of their own. A profile's events name no model.
        where = (f" {model}" if model else "") + (f" v{version}" if version else "")
        fields = {"event": kind, "model": model or None, "version": version}
        log.log(level, "%s%s: %s", kind, where, message, extra=fields)
        for queue in self._subscribers:
            if queue.full():
                queue.get_nowait()  # drop the oldest for a slow reader
            queue.put_nowait(event)
        return event

    def recent(self, model: str | None = None) -> list[Event]:
        return [e for e in self._recent if model is None or e.model == model]

    async def subscribe(self, replay: int = 0) -> AsyncIterator[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue(self._queue_size)
        for event in list(self._recent)[-replay:] if replay else []:
            queue.put_nowait(event)
        self._subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)
