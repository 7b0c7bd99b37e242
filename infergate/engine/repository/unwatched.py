"""While the models folder cannot be watched (inotify's limits: 200,000 empty folders in
one model's folder took every watch, and no model was reloaded again), every model is
looked at in turn, as a model with links is, and a change touches it as an event would.

Each model as often as its own looks allow: every `every_s`, or less often where a look
takes more than `share` of a core. Every model due is queued at each pass, the longest
due first, and POLL_LOOKS look at once: a tree that took the watches, looked at seldom,
holds up one of them, and cheap models, new ones included, never keep another's turn (a
few empty folders beside it, first at every pass, kept a model from ever being looked
at). A model's first look touches it when it is new, or changed since the watch failed
(by its files' mtimes: a change that kept an older one is seen at the next change)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from infergate.clock import Clock
from infergate.engine.repository.model_looks import Snapshot, snapshot
from infergate.engine.repository.scan import model_names

log = logging.getLogger("infergate.watcher")
POLL_LOOKS = 2  # models looked at at once


class UnwatchedLooks:
    """The looks of one stretch without a watch; `close` ends them."""

    def __init__(
        self,
        root: Path,
        clock: Clock,
        known: Callable[[str], bool],
        touched: Callable[[str], None],
        since_ns: int,
        every_s: float,
        share: float,
    ) -> None:
        self._root, self._clock = root, clock
        self._known = known  # whether the registry holds a model of that name
        self._touched = touched  # as an event for the model would
        self._since_ns = since_ns  # wall time (ns) from which no event may have come
        self._every_s, self._share = every_s, share
        self._looked: dict[str, tuple[Snapshot, float]] = {}  # snapshot, when to look next
        self._looking: set[str] = set()  # looked at, or queued for a turn
        self._turns = asyncio.Semaphore(POLL_LOOKS)
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_pass = 0.0

    async def poll(self) -> None:
        """Queue a look at every model due (a pass every `every_s` at most)."""
        now = self._clock.now()
        if now < self._next_pass:
            return
        self._next_pass = now + self._every_s
        names = await asyncio.to_thread(self._names)
        looked = self._looked
        for name in set(looked) - set(names):  # gone
            del looked[name]
            self._touched(name)
        due = [n for n in names if n not in self._looking and looked.get(n, (None, now))[1] <= now]
        due.sort(key=lambda n: looked.get(n, (None, now))[1])
        for name in due:
            self._looking.add(name)
            task = asyncio.create_task(self._look(name), name=f"look:{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    def _names(self) -> list[str]:
        try:
            return model_names(self._root)
        except Exception:
            return []

    async def _look(self, name: str) -> None:
        try:
            async with self._turns:
                started = time.perf_counter()
                try:
                    snap = await asyncio.to_thread(snapshot, self._root, name)
                except Exception as exc:  # an unreadable model must not stop the others
                    log.warning("watcher: cannot look at model %s (%s); skipped", name, exc)
                    return
            spent = time.perf_counter() - started
            before = self._looked.get(name)
            if self._changed(name, snap, None if before is None else before[0]):
                self._touched(name)
            next_look = self._clock.now() + max(self._every_s, spent / self._share)
            self._looked[name] = (snap, next_look)
        finally:
            self._looking.discard(name)

    def _changed(self, name: str, snap: Snapshot, before: Snapshot | None) -> bool:
        """Since the look before, or at a first look, new or changed since the watch
        failed."""
        if before is not None:
            return snap != before
        if not self._known(name):
            return True
        return any(mtime_ns >= self._since_ns for _, _, mtime_ns, _ in snap)
