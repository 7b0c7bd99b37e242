"""Watch the models folder and sync a model once its files have settled.

watchdog reports changes on its own thread; they are handed to the event loop, where a
Settler waits until the model's files stop changing (size and mtime the same for
`stable_s`), so a slow copy or a file written in two halves never loads half-written.

The watcher never dies: a file it cannot look at (a symlink loop, a permission error) is
logged and skipped, any error in a pass is logged and the next pass runs. Every second it
checks that the folder is still the one watched: a models folder deleted and created again
is watched again (and every model in it looked at), and a watch that cannot be set up is
retried with backoff; after a few failures that is an event (`watcher_failed`) and the
`infergate_repository_watching` gauge reads 0 until a retry succeeds.

watchdog watches a new folder's subfolders as it meets their creation events, under the
paths it knows then; a folder built quickly and renamed (the atomic deploy: build in
`models/.staging-x`, then `mv` it to `models/x`) can leave subfolders it met only after the
rename unwatched, so later edits in them would go unseen. So once a model that gained a
folder (made or moved in) has settled, if it holds folders, the watch is renewed: a fresh
observer walks the tree as it is now, and only then is the old one stopped, so no event
falls in between.

A model with a symlink among its paths may change behind the link, outside the models
folder, where no event tells: it is looked at again every CHECK_S (`_check_links`).

A folder tree however deep is walked (`WALK_RECURSION_LIMIT`): Python 3.11's `os.walk`
recurses once a level, in watchdog's walks, and a tree of 1,100 empty folders renamed into
one model's folder raised RecursionError in watchdog's one inotify thread, which died
unseen: no model was reloaded again, the gauge still reading 1. A snapshot looks only
`LOOK_DEPTH` folders deep (model_looks.py).

While the folder cannot be watched (inotify's limits), every model is looked at in turn
instead (unwatched.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from infergate.clock import Clock
from infergate.engine.context import EngineContext
from infergate.engine.lifecycle.registry import Registry
from infergate.engine.repository.model_looks import Snapshot, look
from infergate.engine.repository.scan import model_name_for, model_names
from infergate.engine.repository.unwatched import UnwatchedLooks

log = logging.getLogger("infergate.watcher")


class _QuietStop(logging.Filter):
    """watchdog 7 logs an error when an emitter's loop runs once more after its observer
    stopped it, a race with no harm done; the watch is renewed on each deploy, so say
    nothing of it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_QuietStop())
# What changes a model: not a file opened, or closed unwritten. Asked of inotify, those
# came for every folder and file the watcher itself read (its snapshots, watchdog's walks
# of the tree), filled the kernel's queue in a storm of changes, and each overflow's
# walk made more of them: the queue overflowed every 0.3 s with nothing changing, and a
# deploy was lost in it.
_EVENTS = (
    FileCreatedEvent,
    DirCreatedEvent,
    FileDeletedEvent,
    DirDeletedEvent,
    FileModifiedEvent,
    DirModifiedEvent,
    FileMovedEvent,
    DirMovedEvent,
    FileClosedEvent,
)
CHECK_S = 1.0  # how often the watch itself is checked
ROOM_RETRY_S = 10.0  # a model refused for want of room for its copy is synced again after
LINKS_SHARE = 0.02  # of a core, at most, for looking at models with links (_check_links)
GIVE_UP_AFTER = 3  # failed attempts to watch before it is reported as failed
RETRY_MAX_S = 8.0
WATCH_SHARE = 0.1  # of a core, at most, for tries to watch again (`_watch_failed`)


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
    """Hands each model a change touches to the loop: `touched(name, folder_appeared,
    known_only)`, the last for a path gone from the models folder itself, which only a
    model already known cares about."""

    def __init__(
        self,
        root: Path,
        loop: asyncio.AbstractEventLoop,
        touched: Callable[[str, bool, bool], None],
    ) -> None:
        self._root = root
        self._loop = loop
        self._touched = touched

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        appeared = event.is_directory and event.event_type in ("created", "moved")
        paths = [event.src_path, getattr(event, "dest_path", "")]
        for raw in paths:
            if not raw:
                continue
            path = Path(os.fsdecode(raw))
            folder, known_only = True, False
            if not event.is_directory and path.parent == self._root:
                # In the models folder itself, a file is a model only as a lone model file
                # (a link to a folder is a model's folder). A path gone may have been a
                # link to a model's folder: looked at only for a model known, or a storm
                # of stray files made and deleted made as many models to look for.
                if path.is_file():
                    folder = False
                elif not path.exists():
                    known_only = True
            name = model_name_for(self._root, path, folder=folder)
            if name is not None:
                self._loop.call_soon_threadsafe(self._touched, name, appeared, known_only)


class RepositoryWatcher:
    def __init__(
        self, root: Path, registry: Registry, context: EngineContext, stable_s: float
    ) -> None:
        self._root = root.resolve()
        self._registry = registry
        self._context = context
        self._settler = Settler(context.clock, stable_s)
        self._poll_s = min(0.1, stable_s / 4)
        self._observer: BaseObserver | None = None
        self._handler: _Handler | None = None
        self._watched: tuple[int, int] | None = None  # (st_dev, st_ino) of the folder watched
        self._failures = 0
        self._next_check = 0.0
        self._task: asyncio.Task[None] | None = None
        self._syncs: set[asyncio.Task[object]] = set()
        self._renew_for: set[str] = set()  # models that gained a folder since they settled
        # The models with a symlink among their paths, as last looked at: a change behind a
        # link (a mounted volume's swapped `..data`, a file kept elsewhere) makes no event
        # here, so they are looked at again every CHECK_S (`_check_links`).
        self._linked: dict[str, Snapshot] = {}
        self._next_link_check = 0.0
        # While the folder cannot be watched, the looks at every model (unwatched.py).
        self._unwatched: UnwatchedLooks | None = None
        self._unwatched_ns = 0  # wall time (ns) from which no event may have come
        self._rewatch: asyncio.Task[None] | None = None  # a try to watch again, failing

    @property
    def watching(self) -> bool:
        return self._observer is not None and self._failures == 0

    def start(self) -> None:
        self._handler = _Handler(self._root, asyncio.get_running_loop(), self._touched)
        # Watch before the first scan (the caller scans next), so nothing is missed.
        try:
            self._watch(self._identity())
        except Exception as exc:
            self._watch_failed(exc)
        self._next_check = self._context.clock.now() + CHECK_S
        # Before the first scan too: a link's target changed after it is then seen.
        self._remember_links(self._looks(self._names()))
        self._next_link_check = self._next_check
        self._task = asyncio.create_task(self._run(), name="watcher")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                if self._failures == 0:
                    await self._check_watch()
                elif self._rewatch is None or self._rewatch.done():
                    # Failing, a try may take seconds (watchdog walking a tree until the
                    # inotify limit stops it: 9 s for 200,000 folders), which held up the
                    # looks at every model meanwhile (`_poll_unwatched`).
                    self._rewatch = asyncio.create_task(self._check_watch(), name="rewatch")
                    self._rewatch.add_done_callback(_log_failure)
                await self._check_links()
                for name in self._registry.short_of_room(ROOM_RETRY_S):
                    self._settler.touched(name)
                await self._poll_unwatched()
                await self._settle()
            except Exception:  # whatever went wrong, the next pass runs
                log.exception("watcher: a pass failed; carrying on")

    async def _settle(self) -> None:
        pending = self._settler.pending
        if not pending:
            return
        looks = await asyncio.to_thread(self._looks, pending)
        due = self._settler.poll({name: snap for name, (snap, _) in looks.items()})
        self._remember_links({name: looks[name] for name in due})
        replaced = None
        # (Not while failing: a try to watch again, beside, makes a fresh observer.)
        if self._failures == 0 and (renew := self._renew_for.intersection(due)):
            self._renew_for.difference_update(due)
            try:  # before the sync reads the files
                replaced = await asyncio.to_thread(self._renew_watch_if_nested, renew)
            except Exception as exc:  # _check_watch watches afresh, with backoff
                self._watched = None
                self._watch_failed(exc)
        for name in due:
            task: asyncio.Task[object] = asyncio.create_task(self._registry.sync(name))
            self._syncs.add(task)
            task.add_done_callback(self._sync_done)
        if replaced is not None:  # once the syncs run: stopping it takes a while
            await asyncio.to_thread(_stop, replaced)

    def _sync_done(self, task: asyncio.Task[object]) -> None:
        self._syncs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("watcher: syncing a model failed", exc_info=task.exception())

    def _looks(self, names: list[str]) -> dict[str, tuple[Snapshot, bool]]:
        out = {}
        for name in names:
            try:
                out[name] = look(self._root, name)
            except Exception as exc:  # an unreadable model must not stop the others
                log.warning("watcher: cannot look at model %s (%s); skipped", name, exc)
        return out

    def _remember_links(self, looks: dict[str, tuple[Snapshot, bool]]) -> None:
        for name, (snap, linked) in looks.items():
            if linked:
                self._linked[name] = snap
            else:
                self._linked.pop(name, None)

    async def _check_links(self) -> None:
        """Every CHECK_S (or less often: LINKS_SHARE), a model with a symlink among its
        paths whose files changed (through its links) is touched, as an event would: it
        settles and syncs."""
        now = self._context.clock.now()
        if now < self._next_link_check or not self._linked:
            return
        pending = set(self._settler.pending)  # (looked at until they settle already)
        names = [name for name in self._linked if name not in pending]
        started = time.perf_counter()
        looks = await asyncio.to_thread(self._looks, names)
        # Each CHECK_S, or less often when looking takes more than LINKS_SHARE of a core
        # (400 models linked one by one, a ConfigMap's layout: 85 ms a look).
        spent = time.perf_counter() - started
        self._next_link_check = now + max(CHECK_S, spent / LINKS_SHARE)
        for name, (snap, _) in looks.items():
            if name in self._linked and snap != self._linked[name]:
                self._settler.touched(name)

    async def _poll_unwatched(self) -> None:
        """While the folder cannot be watched, every model is looked at in turn instead
        (unwatched.py); once watched again, no more."""
        if self.watching:
            if self._unwatched is not None:
                self._unwatched.close()
                self._unwatched = None
            return
        if self._unwatched is None:
            self._unwatched = UnwatchedLooks(
                self._root,
                self._context.clock,
                self._registry.has,
                self._settler.touched,
                self._unwatched_ns,
                CHECK_S,
                LINKS_SHARE,
            )
        await self._unwatched.poll()

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = self._root.stat()
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    async def _check_watch(self) -> None:
        """Is the folder still the one watched, by a live observer? If not, watch again."""
        now = self._context.clock.now()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_S
        identity = await asyncio.to_thread(self._identity)
        alive = self._observer_alive()
        if identity is None or (alive and identity == self._watched):
            return  # gone (its models' files were reported removed), or all is well
        rewatch = self._watched is not None or self._failures > 0
        started, tried_at_ns = time.perf_counter(), time.time_ns()
        try:
            await asyncio.to_thread(self._watch, identity)
        except Exception as exc:
            self._watch_failed(exc, time.perf_counter() - started, tried_at_ns)
            return
        if self._failures >= GIVE_UP_AFTER:
            self._context.events.publish("watcher_restored", "", f"watching {self._root} again")
        self._failures = 0
        self._context.metrics.watching.set(1)
        if rewatch:
            log.info("watcher: %s is watched again; looking at every model", self._root)
            names = set(await asyncio.to_thread(self._names))
            for name in names | {r.name for r in self._registry.records()}:
                self._settler.touched(name)

    def _observer_alive(self) -> bool:
        observer = self._observer
        if observer is None or not observer.is_alive():
            return False
        try:  # its thread may change the set meanwhile
            return all(e.is_alive() for e in list(observer.emitters))
        except RuntimeError:
            return True  # look again at the next check

    def _names(self) -> list[str]:
        try:
            return model_names(self._root)
        except Exception:
            return []

    def _touched(self, name: str, folder_appeared: bool, known_only: bool = False) -> None:
        if known_only and not self._registry.has(name):
            return
        self._settler.touched(name)
        if folder_appeared:
            self._renew_for.add(name)

    def _watch(self, identity: tuple[int, int] | None) -> None:
        """A fresh observer on the folder (an observer cannot be restarted)."""
        old, self._observer = self._observer, None
        _stop(old)
        if identity is None:
            raise FileNotFoundError(f"{self._root} does not exist")
        self._observer = self._started_observer()
        self._watched = identity
        self._context.metrics.watching.set(1)

    def _renew_watch_if_nested(self, names: set[str]) -> BaseObserver | None:
        """`_renew_watch` when one of the models that gained a folder now holds folders
        of its own, which watchdog may have missed; a folder without any is watched as
        its event came. (Each renewal walks the whole tree: a storm of empty folders
        made one a pass.)"""
        if any(_holds_folders(self._root / name) for name in names):
            return self._renew_watch()
        return None

    def _renew_watch(self) -> BaseObserver | None:
        """Watch the tree as it is now; the observer replaced is the caller's to stop."""
        observer = self._started_observer()
        old, self._observer = self._observer, observer
        return old

    def _started_observer(self) -> BaseObserver:
        assert self._handler is not None
        return watch_tree(self._root, self._handler)

    def _watch_failed(
        self, exc: Exception, spent_s: float = 0.0, tried_at_ns: int | None = None
    ) -> None:
        """`spent_s`: how long the try took; the next waits long enough that tries take at
        most WATCH_SHARE of a core (one walking 200,000 folders to the inotify limit took
        9 s, every 8 s: a core, and the GIL the looks at the models needed)."""
        self._failures += 1
        if self._failures == 1:  # from the try on: the old watch was stopped then (less
            # the clock's tick: a change in it may look older)
            self._unwatched_ns = (tried_at_ns or time.time_ns()) - 2_000_000_000
        self._context.metrics.watch_failures.inc()
        delay = max(min(RETRY_MAX_S, 0.5 * 2 ** (self._failures - 1)), spent_s / WATCH_SHARE)
        self._next_check = self._context.clock.now() + delay
        log.warning("watcher: cannot watch %s: %s; retrying in %.1f s", self._root, exc, delay)
        if self._failures == GIVE_UP_AFTER:
            self._context.metrics.watching.set(0)
            self._context.events.publish(
                "watcher_failed",
                "",
                f"cannot watch {self._root} for changes ({type(exc).__name__}: {exc}); models "
                "are not reloaded when their files change. Hint: raise the inotify limits "
                "(sysctl fs.inotify.max_user_watches / max_user_instances) or the open file "
                "limit; the gateway keeps retrying, and infergate model load still works",
            )

    async def stop(self) -> None:
        for running in (self._task, self._rewatch):
            if running is not None:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            await asyncio.to_thread(observer.join, 5)
        for task in list(self._syncs):
            task.cancel()
        if self._unwatched is not None:
            self._unwatched.close()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("watcher: a try to watch again failed", exc_info=task.exception())


# A path reaches at most PATH_MAX (4,096) bytes, so `os.walk`, which joins each folder's
# path to its parent's, goes at most 2,048 levels deep ("/x" a level) before the kernel
# refuses the path and the walk skips it: with room for the frames beneath, a walk of any
# tree stays under this. (A frame of a walk is about 0.5 KB of C stack: 2,048 of them fit
# a thread's 8 MB many times.)
WALK_RECURSION_LIMIT = 6000
WALK_STACK_BYTES = 16 << 20  # threads' stacks from the watch on: address space, not memory


def watch_tree(root: Path, handler: FileSystemEventHandler) -> BaseObserver:
    """A started observer of the tree under `root`, for the changes in _EVENTS."""
    if sys.getrecursionlimit() < WALK_RECURSION_LIMIT:
        sys.setrecursionlimit(WALK_RECURSION_LIMIT)  # (see the module docstring)
    # And the stack those frames need, in watchdog's threads (made from here on): a small
    # `ulimit -s` (512 KiB) would end the process with SIGSEGV where the limit was passed.
    if threading.stack_size() < WALK_STACK_BYTES:
        threading.stack_size(WALK_STACK_BYTES)
    observer = Observer()
    try:
        observer.schedule(handler, str(root), recursive=True, event_filter=list(_EVENTS))
        observer.start()
    except BaseException:
        observer.stop()
        raise
    return observer


def _holds_folders(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(entry.is_dir(follow_symlinks=False) for entry in entries)
    except OSError:  # gone, or not a folder: nothing in it to watch
        return False


def _stop(observer: BaseObserver | None) -> None:
    if observer is not None:
        observer.stop()
        with contextlib.suppress(RuntimeError):  # never started
            observer.join(5)
