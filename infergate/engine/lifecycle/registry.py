"""What is loaded: each model's served versions, and `sync`, which brings one model in
line with its files: verify, load the new in fresh workers, warm up, swap atomically,
drain the old, stop it. A failure leaves what serves untouched and says why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from infergate.engine.context import EngineContext
from infergate.engine.lifecycle import version_breaker
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.lifecycle.served import ServedVersion
from infergate.engine.remote.served import REMOTE, RemoteServedVersion, verified_config
from infergate.engine.repository.config_override import ConfigOverrides
from infergate.engine.repository.scan import model_names, scan_model
from infergate.engine.repository.spec import ModelConfig, ModelEntry, ModelVersionFile
from infergate.engine.repository.verify import (
    Digests,
    NoRoom,
    VerificationFailed,
    VerifiedStore,
    VerifyPolicy,
    check_digest,
    verify_file,
)
from infergate.errors import ModelNotFound, shown

if TYPE_CHECKING:  # snapshots read the registry's records
    from infergate.engine.snapshots import WorkerView

# A model file this large is hashed and copied on a thread of its own (Registry._disk_large).
LARGE_FILE_BYTES = 64 * 2**20


def _large(path: Path) -> bool:
    try:
        return os.stat(path).st_size >= LARGE_FILE_BYTES
    except OSError:
        return False  # (the copy says what is wrong with it)


_T = TypeVar("_T")


@dataclass
class ModelRecord:
    """A model the repository holds (or held), and the versions of it being served."""

    name: str
    entry: ModelEntry | None = None
    versions: dict[int, ServedVersion] = field(default_factory=dict)
    problem: str | None = None  # the model as a whole is wrong (model.toml, no file)
    failures: dict[int, str] = field(default_factory=dict)  # version -> why it did not load
    # version -> (sha256, config) of a file that failed, so the same file is not retried
    # until it changes (or a person asks for a load).
    failed_files: dict[int, tuple[str, ModelConfig]] = field(default_factory=dict)
    unloaded: bool = False
    loading: bool = False
    candidates: list[ServedVersion] = field(default_factory=list)  # loading, not swapped in

    def default_version(self) -> ServedVersion | None:
        """The highest served version that is ready, else the highest at all."""
        if len(self.versions) <= 1:  # nothing to choose between (asked on every request)
            return next(iter(self.versions.values()), None)
        served = list(self.versions.values())
        candidates = [v for v in served if v.ready] or served
        return max(candidates, key=lambda v: v.version) if candidates else None

    @property
    def state(self) -> str:
        if self.unloaded:
            return "unloaded"
        default = self.default_version()
        if default is not None:
            return default.state
        if self.loading:
            return "loading"
        return "failed" if self.problem or self.failures else "unavailable"

    @property
    def reason(self) -> str | None:
        if self.unloaded:
            return "unloaded; load it with infergate model load " + self.name
        if self.problem:
            return self.problem + self.keeps_serving(None)
        if self.failures:
            version = max(self.failures)
            return f"version {version}: {self.failures[version]}{self.keeps_serving(version)}"
        default = self.default_version()
        if default is None and self.loading:  # why a load takes long (a remote model's
            # upstream not answering yet, say)
            return next((c.reason for c in self.candidates if c.reason), None)
        return default.reason if default else None

    def keeps_serving(self, failed: int | None) -> str:
        """What serves despite a failure (of version `failed`), as the tail of its reason:
        read when asked, so it never outlives what it says."""
        serving = self.default_version()
        if serving is None or not serving.ready:
            return ""
        if serving.version == failed:
            return f"; version {failed} keeps serving the file it loaded before"
        return f"; version {serving.version} keeps serving"


class Registry:
    def __init__(self, root: Path, context: EngineContext) -> None:
        self.root = root
        self._context = context
        self._records: dict[str, ModelRecord] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._retiring: set[asyncio.Task[None]] = set()
        self.overrides = ConfigOverrides()  # Triton's load-time `parameters.config`
        self._loading: set[ServedVersion] = set()  # candidates not yet swapped in
        self.store = VerifiedStore(context.store_dir)
        self._digests = Digests()  # which files changed, without hashing those that did not
        # Disk work (scans, hashing, copies) runs here, off the loop; two threads, so that
        # hundreds of models loading at once do not crowd the event loop out of the GIL.
        # Large files' hashing and copying run on a thread of their own: two of one
        # tenant's 1.5 GB files held both, and another tenant's small model, changed
        # meanwhile, served 8.5 s later instead of 0.7.
        self._disk = ThreadPoolExecutor(2, thread_name_prefix="infergate-disk")
        self._disk_large = ThreadPoolExecutor(1, thread_name_prefix="infergate-disk-large")
        # Models whose last sync found no room for a copy: when, and how many times in a
        # row. No event comes when room is freed (the watcher syncs them again,
        # `short_of_room`).
        self._short_of_room: dict[str, tuple[float, int]] = {}

    def short_of_room(self, after_s: float) -> list[str]:
        """The models refused for want of room for a copy `after_s` ago or more (twice as
        long after each refusal in a row, up to 32 times: each try is a failure event):
        each is named once, to be synced again (room may have been freed since, which no
        file event tells: a version refused so waited for its folder to change)."""
        now = self._context.clock.now()
        due = [
            name
            for name, (when, tries) in self._short_of_room.items()
            if now - when >= after_s * 2 ** min(tries - 1, 5)
        ]
        for name in due:  # (kept while it waits: its count goes on if refused again)
            when, tries = self._short_of_room[name]
            self._short_of_room[name] = (float("inf"), tries)
        return due

    async def _off_loop(self, fn: Callable[..., _T], *args: object) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._disk, functools.partial(fn, *args))

    def kill_over_memory(self, worker: WorkerView, used_mb: float, tenant_mb: float = 0.0) -> None:
        """The monitor saw `worker` past its memory limit: kill it, if that instance still
        runs that pid (it may have exited, and its pid gone to another instance's worker)."""
        for instance in self.instances():
            spec = instance.spec
            seen = (spec.model, spec.version, instance.index, instance.pid)
            if seen == (worker.model, worker.version, worker.instance, worker.pid):
                if worker.tenant is None:
                    instance.kill_over_memory(used_mb, worker.memory_limit_mb)
                else:
                    left = worker.tenant_left_mb
                    instance.kill_over_memory(used_mb, left, worker.tenant, tenant_mb)
                return

    def instances(self) -> Iterator[Instance]:
        """Every instance with (or about to have) a worker: serving and still loading, so
        limits such as memory_mb hold from the first byte a version loads."""
        for record in list(self._records.values()):
            for served in list(record.versions.values()):
                yield from served.instances
        for served in list(self._loading):
            yield from served.instances

    def loading_instances(self) -> set[int]:
        """The ids of the instances of versions loading, not serving yet."""
        return {id(i) for served in self._loading for i in served.instances}

    def records(self) -> list[ModelRecord]:
        return [self._records[k] for k in sorted(self._records)]

    def has(self, name: str) -> bool:
        return name in self._records

    def record(self, name: str, visible: Callable[[str], bool] | None = None) -> ModelRecord:
        """`visible`: which models the 404 may name (a tenant's allow-list); all if None."""
        try:
            return self._records[name]
        except KeyError:
            known = _listed(n for n in self._records if visible is None or visible(n))
            raise ModelNotFound(
                f"Request for unknown model: {shown(name)} is not found; served models: "
                f"{known}. "
                "Hint: infergate model list"
            ) from None

    async def sync_all(self) -> None:
        names = await self._off_loop(model_names, self.root)
        await asyncio.gather(*(self.sync(name) for name in names))

    async def sync(self, name: str, explicit: bool = False) -> ModelRecord | None:
        """Bring `name` in line with disk. `explicit` (an API load) also reloads files that
        did not change, retries ones that failed, and lifts an unload."""
        async with self._locks[name]:
            return await self._sync(name, explicit)

    async def load(self, name: str, override: dict[str, Any] | None) -> str | None:
        """An API load of `name` with its own config override (None: the files alone, as
        in Triton): None once it serves, else why not. ModelNotFound for no such model.
        The override is set, loaded and judged under the model's lock: set before it, a
        concurrent load's override could be the one loaded, and its failure judged as
        this load's. A failed load puts back the override that serves."""
        async with self._locks[name]:
            previous = self.overrides.get(name)
            self.overrides.set(name, override)
            try:
                record = await self._sync(name, explicit=True)
            except ModelNotFound:
                self.overrides.set(name, None)
                raise
            assert record is not None  # (an explicit sync raises rather than answer None)
            if record.problem or record.failures or record.state != "ready":
                self.overrides.set(name, previous)  # its reason says what keeps serving
                return record.reason or record.state
            return None

    async def _sync(self, name: str, explicit: bool) -> ModelRecord | None:
        """`sync`, under the model's lock."""
        record = self._records.get(name)
        if record is not None and record.unloaded and not explicit:
            return record  # unloaded stays unloaded until someone loads it
        entry = self.overrides.apply(await self._off_loop(scan_model, self.root, name))
        if entry is None:
            if record is not None:
                self._retire(record, list(record.versions), "its files were removed")
                del self._records[name]
                self._context.events.publish("model_removed", name, "files removed")
            elif explicit:
                # (the folders, not the models loaded: in explicit mode a model on disk
                # is not one until loaded, and a typo's fix may be one of those)
                there = _listed(await self._off_loop(model_names, self.root))
                raise ModelNotFound(
                    f"no model {name!r} in {self.root}; models there: {there}. "
                    "Hint: infergate model list"
                )
            return None
        if record is None:
            record = self._records[name] = ModelRecord(name)
        record.unloaded = False
        await self._sync_entry(record, entry, explicit)
        return record

    async def _sync_entry(self, record: ModelRecord, entry: ModelEntry, explicit: bool) -> None:
        record.entry = entry
        record.problem = entry.problem
        if entry.problem:
            self._failed(record, None, entry.problem)
            return  # what serves keeps serving: a broken model.toml replaces nothing
        desired = entry.served_versions()
        record.loading = True
        candidates: list[ServedVersion] = []
        try:
            candidates = await self._candidates(record, entry, desired, explicit)
            record.candidates = candidates
            self._loading.update(candidates)
            for candidate in candidates:
                candidate.start()
            started = self._context.clock.now()
            await asyncio.gather(*(c.wait_settled() for c in candidates))
            load_s = self._context.clock.now() - started
        finally:
            record.loading = False
            record.candidates = []
            self._loading.difference_update(candidates)
        for candidate in candidates:
            self._swap_in(record, candidate, load_s)
        wanted = {f.version for f in desired}
        # Versions that left the policy go once a wanted one serves; until then they are
        # the fallback, since a bad new file must not leave the model with nothing.
        if any(v in record.versions and record.versions[v].ready for v in wanted):
            gone = [v for v in record.versions if v not in wanted]
            self._retire(record, gone, "no longer in the version policy or on disk")
        for version in [v for v in record.failures if v not in wanted]:
            record.failures.pop(version)
            record.failed_files.pop(version, None)

    async def _admitted(
        self, path: Path, pin: str | None, policy: VerifyPolicy, serving: Path | None
    ) -> tuple[str, Path | None]:
        """The file's SHA256, checked (the pin, the signature), and its verified copy when
        it had to be read: a file unchanged since it was hashed is not read (no copy:
        None); one that changed is read once, hashed as it is copied. (It was read twice,
        hashed to see whether it changed, then again as it was copied.) Even `stat` runs
        off the loop: a hung network mount stalls a disk thread, not every request.
        `serving`: the copy that serves this version now, if any (see `_admit`)."""
        cached, large = await self._off_loop(self._known, path, pin, policy)
        if cached is not None:
            return cached, None
        return await self._copied(path, pin, policy, large, or_hash=serving)

    def _known(self, path: Path, pin: str | None, policy: VerifyPolicy) -> tuple[str | None, bool]:
        """(in a disk thread) The file's digest, checked, if it is known for its stamp; else
        None, and whether it is large (LARGE_FILE_BYTES or more)."""
        cached = self._digests.cached(path)
        if cached is not None:
            check_digest(path, cached, pin, policy)
            return cached, False
        return None, _large(path)

    async def _copied(
        self,
        path: Path,
        pin: str | None,
        policy: VerifyPolicy,
        large: bool,
        or_hash: Path | None,
    ) -> tuple[str, Path | None]:
        """`_admit` on the disk threads (the large files' own, for a large one). Cancelled
        (the gateway stops): a copy not started never runs, and one under way is let go
        by its thread once done (awaited from the loop, its result was dropped, and the
        copy counted as used for good)."""
        pool = self._disk_large if large else self._disk
        copying = pool.submit(self._admit, path, pin, policy, or_hash)
        try:
            return await asyncio.wrap_future(copying)
        except asyncio.CancelledError:
            copying.add_done_callback(self._let_go)  # (not started: it is cancelled)
            raise

    def _let_go(self, copying: concurrent.futures.Future[tuple[str, Path | None]]) -> None:
        """(on the thread that copied) A copy nobody awaits any more goes."""
        if not copying.cancelled() and copying.exception() is None:
            stored = copying.result()[1]
            if stored is not None:
                self.store.release(stored)

    def _admit(
        self, path: Path, pin: str | None, policy: VerifyPolicy, or_hash: Path | None = None
    ) -> tuple[str, Path | None]:
        """`store.admit`, its digest remembered for the file's stamp (in a disk thread).
        `or_hash`: the copy serving from this path: with no room for a copy, the digest
        alone (no copy: None) of a file of that copy's size, which may be what serves
        already (touched, its stamp changed, its bytes the same). Only of that size: a
        sparse file of 4 TiB, refused a copy, was hashed whole, holding the large files'
        thread for hours."""
        before, hashed_at = os.stat(path), time.time_ns()
        stored: Path | None
        try:
            sha, stored = self.store.admit(path, pin, policy)
        except NoRoom:
            if or_hash is None or os.stat(or_hash).st_size != before.st_size:
                raise
            sha, stored = verify_file(path, pin, policy), None
        with contextlib.suppress(OSError):
            self._digests.remember(path, before, os.stat(path), sha, hashed_at)
        return sha, stored

    async def _candidates(
        self,
        record: ModelRecord,
        entry: ModelEntry,
        desired: list[ModelVersionFile],
        explicit: bool,
    ) -> list[ServedVersion]:
        """Verified new ServedVersions for the files that differ from what serves. Each
        gets its own read-only copy of the bytes that passed (see VerifiedStore)."""
        out: list[ServedVersion] = []
        pin, policy = entry.config.sha256, self._context.verify
        short_of_room = False
        for file in desired:
            remote = file.runtime == REMOTE
            stored: Path | None = None
            current = record.versions.get(file.version)
            try:
                if remote:  # no model file: model.toml's digest names what serves
                    sha = await self._off_loop(
                        verified_config, file.path, entry.toml_sha256, policy
                    )
                else:
                    serving = current.stored_path if current is not None else None
                    sha, stored = await self._admitted(file.path, pin, policy, serving)
                serves = current is not None and current.same_as(file, sha, entry.config)
                if not explicit and (
                    serves or record.failed_files.get(file.version) == (sha, entry.config)
                ):  # what serves, or the same bad file (wait for it to change)
                    if stored is not None:
                        await self._off_loop(self.store.release, stored)
                    if serves:
                        # The files are what serves again (a bad edit undone): a failure
                        # of the edit's is no longer so ("failed" showed until a load).
                        record.failures.pop(file.version, None)
                        record.failed_files.pop(file.version, None)
                    continue
                if not remote and stored is None:  # unchanged since hashed: copied now
                    large = await self._off_loop(_large, file.path)
                    sha, stored = await self._copied(file.path, pin, policy, large, or_hash=None)
                if not remote and stored is None:  # (never: no or_hash copies or raises)
                    raise VerificationFailed(f"{file.path} has no verified copy to serve")
            except (VerificationFailed, OSError) as exc:
                short_of_room = short_of_room or isinstance(exc, NoRoom)
                self._failed(record, file.version, f"verification failed: {exc}")
                continue
            if remote:
                out.append(RemoteServedVersion(entry, file, sha, self._context))
            else:
                out.append(ServedVersion(entry, file, sha, self._context, stored_path=stored))
            self._context.events.publish(
                "model_loading",
                record.name,
                f"loading {file.path.name} (sha256 {sha[:12]})",
                file.version,
            )
        if short_of_room:  # (once a sync, however many of its versions were refused)
            tries = self._short_of_room.get(record.name, (0.0, 0))[1] + 1
            self._short_of_room[record.name] = (self._context.clock.now(), tries)
        else:
            self._short_of_room.pop(record.name, None)
        return out

    def _swap_in(self, record: ModelRecord, candidate: ServedVersion, load_s: float) -> None:
        version = candidate.version
        if candidate.unavailable is not None and version not in record.versions:
            # Listed, with the install command, so people see why and how to fix it.
            record.versions[version] = candidate
            self._context.events.publish(
                "model_unavailable", record.name, candidate.unavailable, version
            )
            return
        if not candidate.ready:
            reason = candidate.reason or "it did not become ready"
            record.failed_files[version] = (candidate.sha256, candidate.config)
            self._failed(record, version, reason)
            task = asyncio.create_task(self._stop(candidate))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            return
        old = record.versions.get(version)
        record.versions[version] = candidate  # the switch: one assignment on the loop
        version_breaker.show_state(record.name, version, candidate.breaker, self._context)
        record.failures.pop(version, None)
        record.failed_files.pop(version, None)
        if old is not None:
            self._retire_one(record, old, self._replaced(old, candidate))
        self._context.metrics.reloads.labels(record.name, "ready").inc()
        self._context.metrics.reload_seconds.labels(record.name).observe(load_s)
        self._context.events.publish(
            "model_ready",
            record.name,
            f"serving sha256 {candidate.sha256[:12]} after {load_s * 1000:.0f} ms",
            version,
            sha256=candidate.sha256,
            load_s=load_s,
        )

    def _replaced(self, old: ServedVersion, new: ServedVersion) -> str:
        """What changed, for the old version's stop event: its file, its settings, or
        neither (an explicit load of the same files)."""
        changed = old.changed_settings(new)
        source = "model.toml" if self.overrides.get(old.name) is None else "its config"
        settings = f"{source} changed ({', '.join(changed)})"
        if old.file != new.file or old.sha256 != new.sha256:
            return "replaced by a new file" + (f", and {settings}" if changed else "")
        if changed:
            return f"replaced: {settings}"
        return "replaced: reloaded on request, same file and settings"

    def _failed(self, record: ModelRecord, version: int | None, reason: str) -> None:
        if version is not None:
            record.failures[version] = reason
        self._context.metrics.reloads.labels(record.name, "failed").inc()
        keeps = record.keeps_serving(version)
        self._context.events.publish("model_load_failed", record.name, reason + keeps, version)

    def _retire(self, record: ModelRecord, versions: list[int], why: str) -> None:
        for version in versions:
            served = record.versions.pop(version, None)
            if served is not None:
                self._retire_one(record, served, why, gone=True)

    def _retire_one(
        self, record: ModelRecord, served: ServedVersion, why: str, gone: bool = False
    ) -> None:
        """`gone`: no version of its number serves after it (not a replacement's switch),
        so its breaker's gauge goes too once it has stopped."""

        async def drain_and_stop() -> None:
            drained = await served.drain(self._context.drain_timeout_s)
            await self._stop(served)
            if gone and served.version not in record.versions:  # (not loaded again since)
                version_breaker.hide_state(record.name, served.version, self._context)
            self._context.events.publish(
                "model_version_stopped",
                record.name,
                f"{why}; {'drained' if drained else 'drain timed out'}, workers stopped",
                served.version,
            )

        task = asyncio.create_task(drain_and_stop())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def unload(self, name: str) -> None:
        async with self._locks[name]:
            record = self.record(name)
            retiring = list(record.versions.values())
            record.versions.clear()
            record.unloaded = True
            await asyncio.gather(*(v.drain(self._context.drain_timeout_s) for v in retiring))
            await asyncio.gather(*(self._stop(v) for v in retiring))
            for served in retiring:
                version_breaker.hide_state(name, served.version, self._context)
            self._context.events.publish("model_unloaded", name, "drained and stopped")

    async def _stop(self, served: ServedVersion) -> None:
        try:
            await served.stop()
        finally:
            if served.stored_path is not None:
                await self._off_loop(self.store.release, served.stored_path)

    async def stop(self) -> None:
        versions = [v for r in self._records.values() for v in r.versions.values()]
        versions += list(self._loading)
        await asyncio.gather(*(v.stop() for v in versions))
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self._off_loop(self.store.close)
        self._disk.shutdown(wait=False, cancel_futures=True)
        self._disk_large.shutdown(wait=False, cancel_futures=True)


MAX_NAMES_LISTED = 20  # in an error: a repository of thousands is not one line's business


def _listed(names: Iterable[str]) -> str:
    """Model names for an error, sorted: the first MAX_NAMES_LISTED and how many more."""
    ordered = sorted(names)
    if not ordered:
        return "none"
    shown = ", ".join(ordered[:MAX_NAMES_LISTED])
    more = len(ordered) - MAX_NAMES_LISTED
    return f"{shown} and {more} more" if more > 0 else shown
