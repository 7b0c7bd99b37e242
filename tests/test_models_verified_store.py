"""What was verified is what serves: workers load a read-only copy of the bytes that
passed, and only regular files (with a size cap on signatures) are ever read."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infergate.engine.context import EngineContext
from infergate.engine.lifecycle import registry as registry_module
from infergate.engine.lifecycle.registry import Registry
from infergate.engine.repository.verify import (
    MAX_SIGNATURE_BYTES,
    Digests,
    VerificationFailed,
    VerifiedStore,
    VerifyPolicy,
    generate_key,
    load_public_key,
    verify_file,
)
from tests.conftest import write_profile
from tests.fake_workers import FakeWorkers
from tests.full_disk import fill_the_disk
from tests.polling import eventually
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


def test_a_fifo_is_refused_at_once_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    with pytest.raises(VerificationFailed, match="is a FIFO, not a regular file"):
        verify_file(fifo, None, VerifyPolicy())  # returns at once: no writer is awaited
    (tmp_path / "store").mkdir()
    store = VerifiedStore(tmp_path / "store")
    open_fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):  # (each refusal left its copy's fd open)
        with pytest.raises(VerificationFailed, match="is a FIFO"):
            store.admit(fifo, None, VerifyPolicy())
    assert len(os.listdir("/proc/self/fd")) == open_fds
    assert list((tmp_path / "store").iterdir()) == []


def test_a_signature_must_be_a_small_regular_file(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"bytes")
    policy = VerifyPolicy(True, (load_public_key(generate_key(tmp_path / "k.key")),))
    sig = tmp_path / "model.onnx.sig"
    with sig.open("wb") as f:
        f.truncate(1 << 30)  # 1 GB, sparse: it must not be read into memory
    with pytest.raises(VerificationFailed, match=f"larger than {MAX_SIGNATURE_BYTES} bytes"):
        verify_file(model, None, policy)
    sig.unlink()
    os.mkfifo(sig)
    with pytest.raises(VerificationFailed, match="is a FIFO"):
        verify_file(model, None, policy)


def test_the_store_keeps_the_bytes_that_passed(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"good bytes")
    store = VerifiedStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    sha, copy = store.admit(model, None, VerifyPolicy())
    assert sha == hashlib.sha256(b"good bytes").hexdigest()
    model.write_bytes(b"evil bytes")  # replaced after verification
    assert copy.read_bytes() == b"good bytes"
    assert copy.stat().st_mode & 0o777 == 0o444
    with pytest.raises(VerificationFailed, match="pins"):
        store.admit(model, sha, VerifyPolicy())  # the copy's digest is what is checked
    assert sorted(p.name for p in (tmp_path / "store").rglob("*")) == [sha, "model.onnx"]
    store.release(copy)
    assert not copy.exists()


def test_same_bytes_admitted_and_released_at_once_never_fail(tmp_path: Path) -> None:
    """Two models with the same bytes share the store's folder for them: one being loaded
    while the other is released (a reload, a removal) must not fail the load. The folder's
    creation raced its removal: mkdir found it, rmdir took it, and the load failed with
    "File exists" (once in a full test run)."""
    store = VerifiedStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    sources = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        sources.append(tmp_path / name / "model.onnx")
        sources[-1].write_bytes(b"the same bytes")
    errors: list[BaseException] = []

    def churn(source: Path) -> None:
        try:
            for _ in range(1500):
                _, copy = store.admit(source, None, VerifyPolicy())
                store.release(copy)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(source,)) for source in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert list((tmp_path / "store").iterdir()) == []  # every copy and folder went


@pytest.fixture
def pinned(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    models = tmp_path / "models"
    path = make_scripted(models / "pinned" / "1" / "model.scripted", controls=("crash",))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    (models / "pinned" / "model.toml").write_text(f'sha256 = "{sha}"\ninstances = 2\n')
    profile = write_profile(tmp_path, "[server]\nfile_stable_s = 0.1\n")
    proc = ServerProcess(models, profile, tmp_path / "server.log")
    yield proc.start(), path
    proc.stop()


def infer(server: ServerProcess, name: str, **controls: int) -> httpx.Response:
    body = scripted_inputs(rows=1, **controls)
    return httpx.post(f"{server.url}/v2/models/{name}/infer", json=body, timeout=30)


def test_a_replaced_file_never_serves_even_after_restarts(
    pinned: tuple[ServerProcess, Path],
) -> None:
    server, path = pinned
    verified = hashlib.sha256(path.read_bytes()).hexdigest()
    # The file is replaced on disk: the pin refuses it, and restarts load the copy.
    path.write_text(path.read_text() + 'load_fail = "the tampered bytes were loaded"\n')
    deadline = time.monotonic() + 30
    while "pins" not in str(server.model("pinned")["failures"]):
        assert time.monotonic() < deadline, server.model("pinned")
        time.sleep(0.05)
    before = set(server.worker_pids("pinned"))
    # Retried once on the sibling, the request ends both workers.
    assert infer(server, "pinned", crash=1).status_code == 503
    deadline = time.monotonic() + 60
    while True:
        model = server.model("pinned")
        pids = set(server.worker_pids("pinned"))
        states = [i["state"] for v in model["versions"] for i in v["instances"]]
        if states == ["ready", "ready"] and not pids & before:
            break
        assert "tampered" not in str(model), model
        assert time.monotonic() < deadline, model
        time.sleep(0.05)
    assert infer(server, "pinned", crash=0).status_code == 200
    meta = httpx.get(f"{server.url}/v2/models/pinned", timeout=5).json()
    assert meta["parameters"]["sha256"] == verified


def test_fifo_signatures_fail_and_do_not_block_shutdown(tmp_path: Path) -> None:
    models = tmp_path / "models"
    for i in range(8):
        make_scripted(models / f"m{i}" / "1" / "model.scripted")
        os.mkfifo(models / f"m{i}" / "1" / "model.scripted.sig")
    make_scripted(models / "huge" / "1" / "model.scripted")
    with (models / "huge" / "1" / "model.scripted.sig").open("wb") as f:
        f.truncate(1 << 30)
    generate_key(tmp_path / "team.key")
    profile = write_profile(
        tmp_path, '[server]\nrequire_signed_models = true\ntrusted_keys = ["team.key.pub"]\n'
    )
    proc = ServerProcess(models, profile, tmp_path / "server.log").start()
    try:
        for i in range(8):
            model = proc.wait_model_state(f"m{i}", "failed", timeout_s=30)
            assert "is a FIFO, not a regular file" in model["reason"]
        huge = proc.wait_model_state("huge", "failed", timeout_s=30)
        assert f"larger than {MAX_SIGNATURE_BYTES} bytes" in huge["reason"]
    finally:
        assert proc.process is not None
        started = time.monotonic()
        proc.process.send_signal(signal.SIGTERM)
        proc.process.wait(timeout=30)
        assert time.monotonic() - started < 10
        proc.stop()


def test_a_store_is_swept_only_when_no_process_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway sweeps the stores that killed gateways left behind. A live gateway in
    another PID namespace sharing /tmp has a pid this one cannot see: its store was swept
    by pid, and its next worker restart found no model file (503 until restarted). Now a
    store is an orphan only when no process holds its lock, whatever its name says."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / "infergate-verified-999999999-dead"  # a pid nobody has
    foreign = tmp_path / "infergate-verified-999999998-foreign"  # ... but held
    # An older gateway, which takes no lock, with a live pid: never swept while it lives.
    older = tmp_path / f"infergate-verified-{os.getpid()}-older"
    for folder in (dead, foreign, older):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"bytes")
    holder = subprocess.Popen(  # another process, as another namespace's gateway
        [sys.executable, "-c", HOLD_A_LOCK, str(foreign)], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"held\n"
        store = VerifiedStore()
        try:
            root = store.root  # made here: the sweep runs first
            assert not dead.exists()
            assert (foreign / "model.onnx").exists()
            assert (older / "model.onnx").exists()
            assert not list(tmp_path.glob(".infergate-verified-*"))  # (its name while made)
            other = VerifiedStore()
            assert other.root != root
            assert root.exists()  # this store is held by its own gateway, alive
            other.close()
        finally:
            store.close()
    finally:
        holder.kill()
        holder.communicate()  # (and its pipe closed)
    last = VerifiedStore()
    assert last.root.exists()  # its holder gone, the foreign store is swept this time
    last.close()
    assert not foreign.exists()


HOLD_A_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(3600)  # (until the test kills it)
"""


def test_a_file_whose_copy_would_fill_the_disk_is_refused_before_copying(tmp_path: Path) -> None:
    """A sparse file takes no room in the repository and all of its size as a copy: two
    of 1 GB took 2 GB of /tmp, and one past the free space would fill the disk. It is
    refused, naming the room there is, before a byte is copied."""
    (tmp_path / "store").mkdir()
    fs = os.statvfs(tmp_path)
    model = tmp_path / "model.onnx"
    with model.open("wb") as f:
        f.truncate(fs.f_bavail * fs.f_frsize + (2 << 30))  # sparse: past what is free
    store = VerifiedStore(tmp_path / "store")
    with pytest.raises(VerificationFailed, match=r"MiB \(sparse\), and .* MiB is kept free"):
        store.admit(model, None, VerifyPolicy())
    assert list((tmp_path / "store").iterdir()) == []  # nothing copied, nothing left


def test_a_small_file_system_keeps_a_share_free_not_a_gibibyte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a tmpfs /tmp of 512 MiB with 100 MiB free, a 1 GiB reserve refused every model,
    a kilobyte too. The reserve is a twentieth of such a file system."""
    (tmp_path / "store").mkdir()
    model = tmp_path / "model.onnx"
    model.write_bytes(b"a small model")
    real = os.fstatvfs

    def small(fd: int) -> os.statvfs_result:
        fs = real(fd)
        fields = list(fs)
        fields[1], fields[2], fields[4] = 4096, 131_072, 25_600  # frsize, blocks, bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "fstatvfs", small)
    store = VerifiedStore(tmp_path / "store")
    _, copy = store.admit(model, None, VerifyPolicy())
    assert copy.read_bytes() == b"a small model"
    with model.open("wb") as f:
        f.truncate(90 << 20)  # 90 MiB of the 100 free: past what leaves 25.6 MiB
    with pytest.raises(VerificationFailed, match="100 MiB free, of which 26 MiB is kept free"):
        store.admit(model, None, VerifyPolicy())


async def test_a_file_is_read_once_a_change_and_not_while_it_does_not_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sync of a model hashed every file it serves to find it unchanged: a 10 GB
    model was read whole on every event in its folder; and a changed file was read twice,
    hashed to see that it changed, then again as it was copied. A changed file is now
    read once (hashed as it is copied); a settled one (times over 2 s old when hashed)
    not again while stat says the same of it; a change, even of the same size under a
    restored mtime, moves its ctime and is read again. A file written within the last
    2 s is read at each sync (a second write in the same clock tick would leave its times
    as they were), its copy let go when it is what serves."""
    hashed: list[int] = []
    real = hashlib.sha256

    def counting() -> Any:
        hashed.append(1)
        return real()

    monkeypatch.setattr(hashlib, "sha256", counting)  # (verify.py calls it by this name)
    model = tmp_path / "models" / "m" / "1" / "model.scripted"
    make_scripted(model, controls=())
    registry = Registry(tmp_path / "models", EngineContext(worker_factory=FakeWorkers()))
    sha = real(model.read_bytes()).hexdigest()
    # "Just written", on a machine of any speed: its times within the hour.
    monkeypatch.setattr(Digests, "SETTLED_NS", 3600 * 10**9)
    try:
        await registry.sync("m")
        assert len(hashed) == 1  # read once: hashed as it was copied
        await registry.sync("m")
        assert len(hashed) == 2  # just written: not trusted
        old = time.time_ns() - 10**10
        os.utime(model, ns=(old, old))
        monkeypatch.setattr(Digests, "SETTLED_NS", 0)  # (ctime cannot be set back)
        for _ in range(3):
            await registry.sync("m")
        assert len(hashed) == 3  # read once more, then known
        assert [p.name for p in registry.store.root.iterdir()] == [sha]  # copies let go
        make_scripted(model, controls=("crash",))  # changed
        os.utime(model, ns=(old, old))
        await registry.sync("m")
        assert len(hashed) == 4
        assert registry.record("m").versions[1].sha256 == real(model.read_bytes()).hexdigest()
    finally:
        await registry.stop()


async def test_a_small_model_loads_while_large_files_are_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of a tenant's 1.5 GB files held both of the registry's disk threads, and
    another tenant's small model, changed meanwhile, served 8.5 s later instead of 0.7.
    Large files are hashed and copied on a thread of their own (here, the copies of two
    "large" files of 2 KB are held until the small model has loaded)."""
    monkeypatch.setattr(registry_module, "LARGE_FILE_BYTES", 2048)
    release = threading.Event()
    admit = VerifiedStore.admit

    def held(store: VerifiedStore, source: Path, *args: Any) -> tuple[str, Path]:
        if source.stat().st_size >= 2048:
            assert release.wait(30), "the large copies were never let go"
        return admit(store, source, *args)

    monkeypatch.setattr(VerifiedStore, "admit", held)
    models = tmp_path / "models"
    for name in ("large1", "large2"):
        make_scripted(models / name / "1" / "model.scripted", controls=())
        with (models / name / "1" / "model.scripted").open("a") as f:
            f.write("#" * 4096 + "\n")
    make_scripted(models / "small" / "1" / "model.scripted", controls=())
    registry = Registry(models, EngineContext(worker_factory=FakeWorkers()))
    large = [asyncio.create_task(registry.sync(name)) for name in ("large1", "large2")]
    try:
        await asyncio.wait_for(registry.sync("small"), 30)
        assert 1 in registry.record("small").versions
        assert not any(task.done() for task in large)
    finally:
        release.set()
        await asyncio.gather(*large)
        await registry.stop()


@pytest.mark.parametrize(("written_mib", "second_mib", "fits"), [(0, 40, False), (20, 30, True)])
def test_copies_under_way_count_against_the_room_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written_mib: int, second_mib: int, fits: bool
) -> None:
    """Each copy checked the room for itself alone: two at once, each fitting, could
    together fill the disk. A copy under way counts for what it has still to write (what
    it wrote is gone from the room already). A file system of 512 MiB with 100 MiB free
    before the copies, 25.6 MiB of it kept: while a copy of 40 MiB has written nothing, a
    second of 40 is refused; once it has written 20, a second of 30 fits (counting the
    first's 40 again, it was refused)."""
    store_root = tmp_path / "store"
    store_root.mkdir()
    real = os.fstatvfs

    def small(fd: int) -> os.statvfs_result:
        written = sum(f.stat().st_size for f in store_root.rglob("*") if f.is_file())
        fields = list(real(fd))
        fields[1], fields[2] = 4096, 131_072  # 512 MiB
        fields[4] = 25_600 - written // 4096  # 100 MiB free before the copies
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "fstatvfs", small)
    started, release = threading.Event(), threading.Event()
    sha256 = hashlib.sha256

    class Held:
        """The first copy's digest: it waits once `written_mib` are copied, until the test
        lets it go."""

        def __init__(self) -> None:
            self._digest = sha256()
            self._seen = 0

        def update(self, chunk: bytes) -> None:
            if self._seen == written_mib << 20:
                started.set()
                assert release.wait(30)
            self._seen += len(chunk)
            self._digest.update(chunk)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

    files = []
    for name, mib in (("a.onnx", 40), ("b.onnx", second_mib)):
        with (tmp_path / name).open("wb") as f:
            f.truncate(mib << 20)
        files.append(tmp_path / name)
    store = VerifiedStore(store_root)
    monkeypatch.setattr(hashlib, "sha256", Held)
    first = threading.Thread(target=store.admit, args=(files[0], None, VerifyPolicy()))
    first.start()
    try:
        assert started.wait(30)
        monkeypatch.setattr(hashlib, "sha256", sha256)
        if fits:
            _, copy = store.admit(files[1], None, VerifyPolicy())
            assert copy.stat().st_size == second_mib << 20
        else:
            with pytest.raises(VerificationFailed, match="MiB free"):
                store.admit(files[1], None, VerifyPolicy())
    finally:
        release.set()
        first.join(30)
    if not fits:  # the first is done and counts for nothing more: 30 MiB fit in 34.4
        with (tmp_path / "c.onnx").open("wb") as f:
            f.truncate(30 << 20)
        _, copy = store.admit(tmp_path / "c.onnx", None, VerifyPolicy())
        assert copy.stat().st_size == 30 << 20


def test_a_file_that_grows_as_it_is_copied_is_refused_at_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy read its file to the end: a file of 1.2 GiB when the room was checked, grown
    to 50 GiB as it was copied, filled the copies' file system; and a "regular" file that
    never ends (/proc/kmsg, size 0) held a disk thread for good. A copy reads the size the
    room was checked for, no more, and a file whose size changed meanwhile is refused (it
    is read again once it settles)."""
    source = tmp_path / "model.onnx"
    source.write_bytes(b"x" * (3 << 20))
    started, release = threading.Event(), threading.Event()
    sha256 = hashlib.sha256

    class Held:
        def __init__(self) -> None:
            self._digest = sha256()

        def update(self, chunk: bytes) -> None:
            started.set()
            assert release.wait(30)
            self._digest.update(chunk)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

    (tmp_path / "store").mkdir()
    store = VerifiedStore(tmp_path / "store")
    monkeypatch.setattr(hashlib, "sha256", Held)
    refused: list[BaseException] = []

    def admit() -> None:
        try:
            store.admit(source, None, VerifyPolicy())
        except VerificationFailed as exc:
            refused.append(exc)

    copying = threading.Thread(target=admit)
    copying.start()
    try:
        assert started.wait(30)
        with source.open("ab") as f:
            f.write(b"y" * (5 << 20))  # it grows mid-copy
    finally:
        release.set()
        copying.join(30)
    assert "changed size while it was read (3,145,728 bytes, then 8,388,608)" in str(refused[0])
    assert list((tmp_path / "store").iterdir()) == []  # nothing kept, nothing half-written
    monkeypatch.setattr(hashlib, "sha256", sha256)
    proc_file = Path("/proc/self/status")  # size 0, yet it reads a page
    _, copy = store.admit(proc_file, None, VerifyPolicy())
    assert copy.stat().st_size == 0


async def test_a_touched_file_that_serves_needs_no_room_for_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose stamp changed (touched, chmod) is read again, copied as it is hashed:
    on a disk without room for a second copy, a file that is what serves failed to load
    ("verification failed") and its model showed a failure. Without the room, its digest
    alone tells it serves already. Only a file of the serving copy's size is hashed so:
    a sparse file of 4 TiB in place of a served model was hashed whole, holding the
    large files' thread for hours."""
    model = tmp_path / "models" / "m" / "1" / "model.scripted"
    make_scripted(model, controls=())
    registry = Registry(tmp_path / "models", EngineContext(worker_factory=FakeWorkers()))
    hashed: list[Path] = []

    def verify(path: Path, pin: str | None, policy: VerifyPolicy) -> str:
        hashed.append(path)  # (hashed alone, without a copy)
        return verify_file(path, pin, policy)

    monkeypatch.setattr(registry_module, "verify_file", verify)
    try:
        await registry.sync("m")
        serving = registry.record("m").versions[1]
        fill_the_disk(monkeypatch)
        os.chmod(model, 0o640)  # its ctime moves: read again
        await registry.sync("m")
        assert registry.record("m").versions[1] is serving
        assert registry.record("m").failures == {}
        assert hashed == [model]
        make_scripted(model, controls=("crash",))  # changed: no room is a failure now
        await registry.sync("m")
        assert "MiB is kept free" in registry.record("m").failures[1]
        assert registry.record("m").versions[1] is serving
        hashed.clear()
        with model.open("r+b") as f:
            f.truncate(8 << 20)  # sparse: no room taken in the repository
        await registry.sync("m")
        assert "MiB is kept free" in registry.record("m").failures[1]
        assert hashed == []  # another size than the serving copy's: refused unread
        assert registry.record("m").versions[1] is serving
    finally:
        await registry.stop()


async def test_a_copy_cancelled_midway_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway stopping cancels a sync while a disk thread copies a file: the copy,
    finished after, was counted as used for good (its bytes kept until exit)."""
    entered, release = threading.Event(), threading.Event()
    admit = VerifiedStore.admit

    def held(store: VerifiedStore, source: Path, *args: Any) -> tuple[str, Path]:
        entered.set()
        assert release.wait(30)
        return admit(store, source, *args)

    monkeypatch.setattr(VerifiedStore, "admit", held)
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=())
    registry = Registry(tmp_path / "models", EngineContext(worker_factory=FakeWorkers()))
    try:
        syncing = asyncio.create_task(registry.sync("m"))
        await eventually(entered.is_set, what="the copy to start")
        syncing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await syncing
        release.set()
        store = registry.store.root

        def emptied() -> bool:
            return not any(p.is_file() for p in store.rglob("*"))

        await eventually(emptied, what="the cancelled copy to be let go")
    finally:
        release.set()
        await registry.stop()


async def test_a_hung_stat_holds_a_disk_thread_not_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync looked at its files' stamps (stat) on the event loop: a model folder on a
    hung network mount stalled every request. The looks run on the disk threads: while
    one hangs, another model syncs."""
    for name in ("slow", "quick"):
        make_scripted(tmp_path / "models" / name / "1" / "model.scripted", controls=())
    registry = Registry(tmp_path / "models", EngineContext(worker_factory=FakeWorkers()))
    armed, hung, release = threading.Event(), threading.Event(), threading.Event()
    on_loop: list[bool] = []
    real = Digests.cached

    def hanging(self: Digests, model_file: Path) -> str | None:
        if armed.is_set() and model_file.parent.parent.name == "slow":
            on_loop.append(threading.current_thread() is threading.main_thread())
            hung.set()
            if not on_loop[-1]:  # (on the loop, it would hang the test itself)
                assert release.wait(30)
        return real(self, model_file)

    monkeypatch.setattr(Digests, "cached", hanging)
    try:
        await registry.sync("slow")  # hashed and copied: its stamp now known
        armed.set()
        slow = asyncio.create_task(registry.sync("slow"))
        await eventually(hung.is_set, what="the slow model's stat to start")
        await asyncio.wait_for(registry.sync("quick"), 30)
        assert registry.record("quick").versions[1].sha256 is not None
        assert not slow.done()
        release.set()
        await slow
        assert on_loop == [False]
    finally:
        release.set()
        await registry.stop()
