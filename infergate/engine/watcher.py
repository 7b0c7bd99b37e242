"""Watch the models folder and sync a model once its files have settled.

watchdog reports changes on its own thread; they are handed to the event loop, where a
Settler waits until the model's files stop changing (size and mtime the same for
`stable_s`), so a slow copy or a file written in two halves never loads half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from infergate.clock import Clock
from infergate.engine.context import EngineContext
from infergate.engine.registry import Registry
from infergate.engine.repository import is_ignored, model_name_for
from infergate.engine.runtimes import model_suffixes

Snapshot = tuple[tuple[str, int, int], ...]


def snapshot(root: Path, name: str) -> Snapshot:
    """Size and mtime of every file that makes up model `name`."""
    rows: list[tuple[str, int, int]] = []
    folder = root / name
    if folder.is_dir():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not is_ignored(Path(d))]
            for filename in filenames:
                if is_ignored(Path(filename)):
                    continue
                path = Path(dirpath) / filename
                with contextlib.suppress(FileNotFoundError):
                    st = path.stat()
                    rows.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    for suffix in model_suffixes():
        for path in (root / f"{name}{suffix}", root / f"{name}{suffix}.sig"):
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                rows.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(rows))


class Settler:
    """Which touched models have been still for `stable_s`. Pure logic on a Clock."""

    def __init__(self, clock: Clock, stable_s: float) -> None:
        self._clock = clock
        self._stable_s = stable_s
        self._pending: dict[str, tuple[Snapshot | None, float]] = {}

    def touched(self, name: str) -> None:
        self._pending[name] = (None, self._clock.now())

    @property
    def pending(self) -> list[str]:
        return sorted(self._pending)

    def poll(self, look: dict[str, Snapshot]) -> list[str]:
        """Give the current snapshots of the pending models; get those now settled."""
        now = self._clock.now()
        due = []
        for name, current in look.items():
            if name not in self._pending:
                continue
            previous, since = self._pending[name]
            if current != previous:
                self._pending[name] = (current, now)
            elif now - since >= self._stable_s:
                due.append(name)
                del self._pending[name]
        return due


class _Handler(FileSystemEventHandler):
    def __init__(self, root: Path, loop: asyncio.AbstractEventLoop, settler: Settler) -> None:
        self._root = root
        self._loop = loop
        self._settler = settler

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        paths = [event.src_path, getattr(event, "dest_path", "")]
        for raw in paths:
            if not raw:
                continue
            path = Path(os.fsdecode(raw))
            name = model_name_for(self._root, path)
            if name is not None:
                self._loop.call_soon_threadsafe(self._settler.touched, name)


class RepositoryWatcher:
    def __init__(
        self, root: Path, registry: Registry, context: EngineContext, stable_s: float
    ) -> None:
        self._root = root.resolve()
        self._registry = registry
        self._settler = Settler(context.clock, stable_s)
        self._poll_s = min(0.1, stable_s / 4)
        self._observer = Observer()
        self._task: asyncio.Task[None] | None = None
        self._syncs: set[asyncio.Task[object]] = set()

    def start(self) -> None:
        handler = _Handler(self._root, asyncio.get_running_loop(), self._settler)
        self._observer.schedule(handler, str(self._root), recursive=True)
        self._observer.start()
        self._task = asyncio.create_task(self._run(), name="watcher")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            pending = self._settler.pending
            if not pending:
                continue
            look = await asyncio.to_thread(self._snapshots, pending)
            for name in self._settler.poll(look):
                task: asyncio.Task[object] = asyncio.create_task(self._registry.sync(name))
                self._syncs.add(task)
                task.add_done_callback(self._syncs.discard)

    def _snapshots(self, names: list[str]) -> dict[str, Snapshot]:
        return {name: snapshot(self._root, name) for name in names}

    async def stop(self) -> None:
        self._observer.stop()
        await asyncio.to_thread(self._observer.join, 5)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._syncs):
            task.cancel()
