"""The pure parts of watching: which model a path belongs to, and when files have settled."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from watchdog.events import (
    DirCreatedEvent,
    DirMovedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.inotify_c import InotifyConstants

from infergate.clock import FakeClock
from infergate.engine.repository.model_looks import LOOK_DEPTH, look, snapshot
from infergate.engine.repository.scan import model_name_for
from infergate.engine.repository.watcher import Settler, _Handler, watch_tree
from tests.polling import wait_until

ROOT = Path("/models")


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/models/digits/1/model.onnx", "digits"),
        ("/models/digits/model.toml", "digits"),
        ("/models/digits/2", "digits"),
        ("/models/digits/1/model.onnx.sig", "digits"),
        ("/models/plain.onnx", "plain"),
        ("/models/plain.onnx.sig", "plain"),
        ("/models/enc.pt", "enc"),
        ("/models/digits/1/.model.onnx.tmp", None),
        ("/models/digits/1/model.onnx~", None),
        ("/models/digits/1/model.onnx.part", None),
        ("/models/.git/config", None),
        ("/elsewhere/x.onnx", None),
    ],
)
def test_model_name_for(path: str, name: str | None) -> None:
    assert model_name_for(ROOT, Path(path)) == name


def test_a_file_in_the_models_folder_is_a_model_only_as_a_lone_model_file() -> None:
    """A storm of stray files there (16,000 in 3 s) each made a model to look for."""
    assert model_name_for(ROOT, Path("/models/junk1.txt"), folder=False) is None
    assert model_name_for(ROOT, Path("/models/README"), folder=False) is None
    assert model_name_for(ROOT, Path("/models/plain.onnx"), folder=False) == "plain"
    assert model_name_for(ROOT, Path("/models/plain.onnx.sig"), folder=False) == "plain"
    assert model_name_for(ROOT, Path("/models/v1.2"), folder=True) == "v1.2"
    assert model_name_for(ROOT, Path("/models/m/notes.txt"), folder=False) == "m"


def test_the_watch_asks_for_no_event_that_reading_makes(tmp_path: Path) -> None:
    """Opening a file or folder, or closing it unwritten, changes no model; asked for,
    those events came for every path the watcher itself read (its snapshots, watchdog's
    walks), filled the kernel's queue in a storm of changes, and each overflow's walk made
    more: the queue overflowed every 0.3 s with nothing changing, and a deploy was lost."""
    observer = watch_tree(tmp_path, FileSystemEventHandler())
    try:
        [emitter] = list(observer.emitters)
        mask = emitter.get_event_mask_from_filter()  # type: ignore[attr-defined]
    finally:
        observer.stop()
        observer.join(5)
    reading = InotifyConstants.IN_OPEN | InotifyConstants.IN_CLOSE_NOWRITE
    assert mask & reading == 0
    assert mask & InotifyConstants.IN_ACCESS == 0
    changing = (
        InotifyConstants.IN_CREATE,
        InotifyConstants.IN_DELETE,
        InotifyConstants.IN_MODIFY,
        InotifyConstants.IN_ATTRIB,
        InotifyConstants.IN_MOVED_FROM,
        InotifyConstants.IN_MOVED_TO,
        InotifyConstants.IN_CLOSE_WRITE,
    )
    assert all(mask & event for event in changing)


def deep_tree(folder: Path, levels: int) -> None:
    """`levels` nested folders under `folder`, made relative to each other (a path past
    PATH_MAX needs no long path)."""
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)


def remove_deep_tree(folder: Path) -> None:
    """What `deep_tree` made (shutil.rmtree recurses a level at a time too)."""
    fds = [os.open(folder, os.O_RDONLY)]
    try:
        while True:
            try:
                fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
            except FileNotFoundError:
                break
        while len(fds) > 1:
            os.close(fds.pop())
            os.rmdir("d", dir_fd=fds[-1])
    finally:
        for fd in fds:
            os.close(fd)
    folder.rmdir()


def test_a_deep_folder_tree_in_one_model_leaves_the_others_watched(tmp_path: Path) -> None:
    """A tree of 1,100 empty folders renamed into one model's folder raised RecursionError
    in watchdog's one inotify thread (Python 3.11's os.walk recurses a level at a time),
    which died unseen: no model was reloaded again. A snapshot looks LOOK_DEPTH folders
    deep, no deeper (each look walked the whole tree, its cost the square of its depth)."""
    models = tmp_path / "models"
    (models / "alice" / "1").mkdir(parents=True)
    deep_tree(tmp_path / "staging", 1100)
    (models / "bob" / "1" / "weights").mkdir(parents=True)
    (models / "bob" / "1" / "weights" / "w.bin").write_bytes(b"w")
    seen: list[str] = []

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            seen.append(os.fsdecode(event.src_path))

    observer = watch_tree(models, Handler())
    try:
        os.rename(tmp_path / "staging", models / "bob" / "junk")
        wait_until(lambda: any(p.endswith("/junk") for p in seen), what="the rename's event")
        model = models / "alice" / "1" / "model.onnx"
        model.write_bytes(b"new")
        wait_until(lambda: str(model) in seen, what="alice's file's event")
        deepest = models / "bob" / "junk" / Path(*["d"] * (LOOK_DEPTH - 1))
        inside, beyond = deepest / "in.bin", deepest / "d" / "beyond.bin"
        inside.write_bytes(b"x")
        beyond.write_bytes(b"x")
        files = [row[0] for row in look(models, "bob")[0]]
        assert files == ["bob/1/weights/w.bin", str(inside.relative_to(models))]
        inside.unlink()
        beyond.unlink()
    finally:
        observer.stop()
        observer.join(5)
        remove_deep_tree(models / "bob" / "junk")


def test_settles_only_after_files_stop_changing() -> None:
    clock = FakeClock()
    settler = Settler(clock, stable_s=1.0)
    settler.touched("m")
    assert settler.poll({"m": (("a", 10, 1, 7),)}) == []  # first look
    clock.advance(0.6)
    assert settler.poll({"m": (("a", 20, 2, 7),)}) == []  # still growing: the clock restarts
    clock.advance(0.6)
    assert settler.poll({"m": (("a", 20, 2, 7),)}) == []  # still only 0.6 s unchanged
    clock.advance(0.5)
    assert settler.poll({"m": (("a", 20, 2, 7),)}) == ["m"]
    assert settler.pending == []
    assert settler.poll({"m": (("a", 20, 2, 7),)}) == []  # acted on once


def test_a_new_event_restarts_the_wait() -> None:
    clock = FakeClock()
    settler = Settler(clock, stable_s=1.0)
    settler.touched("m")
    settler.poll({"m": ()})
    clock.advance(0.9)
    settler.touched("m")  # e.g. a rename that kept size and mtime
    settler.poll({"m": ()})
    clock.advance(0.5)
    assert settler.poll({"m": ()}) == []
    clock.advance(0.6)
    assert settler.poll({"m": ()}) == ["m"]


def test_snapshot_sees_size_and_ignores_temporaries(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"12345")
    (tmp_path / "m" / "1" / ".model.onnx.tmp").write_bytes(b"partial")
    (tmp_path / "lone.onnx").write_bytes(b"1")
    [(path, size, *_)] = snapshot(tmp_path, "m")
    assert (path, size) == ("m/1/model.onnx", 5)
    assert [row[:2] for row in snapshot(tmp_path, "lone")] == [("lone.onnx", 1)]


def test_look_says_whether_a_model_is_linked_and_follows_a_linked_version_folder(
    tmp_path: Path,
) -> None:
    """A model with a symlink among its paths is looked at again by the watcher (a change
    behind a link makes no event), and a linked version folder's files are in its snapshot."""
    models, outside = tmp_path / "models", tmp_path / "outside"
    (models / "plain" / "1").mkdir(parents=True)
    (models / "plain" / "1" / "model.onnx").write_bytes(b"123")
    (outside / "v2").mkdir(parents=True)
    (outside / "v2" / "model.onnx").write_bytes(b"12345")
    (outside / "v2" / ".hidden.tmp").write_bytes(b"x")
    (models / "folder" / "1").mkdir(parents=True)
    (models / "folder" / "1" / "model.onnx").write_bytes(b"1")
    os.symlink(outside / "v2", models / "folder" / "2")
    (models / "file" / "1").mkdir(parents=True)
    os.symlink(outside / "v2" / "model.onnx", models / "file" / "1" / "model.onnx")
    assert look(models, "plain")[1] is False
    snap, linked = look(models, "folder")
    assert linked
    assert [row[:2] for row in snap] == [
        ("folder/1/model.onnx", 1),
        ("folder/2/model.onnx", 5),
    ]
    snap, linked = look(models, "file")
    assert linked
    assert [row[:2] for row in snap] == [("file/1/model.onnx", 5)]
    # Swapped to another file of the same size and mtime: another snapshot all the same.
    (outside / "v3").mkdir()
    twin = outside / "v3" / "model.onnx"
    twin.write_bytes(b"54321")
    stat = (outside / "v2" / "model.onnx").stat()
    os.utime(twin, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(_link(models / "file" / "1" / ".swap", twin), models / "file" / "1" / "model.onnx")
    assert look(models, "file")[0] != snap
    # A linked folder whose target is gone is still linked (the volume may come back), and
    # so is a model with a link deeper down.
    os.symlink(outside / "gone", models / "dangling")
    assert look(models, "dangling") == ((), True)
    (models / "deep" / "1").mkdir(parents=True)
    (models / "deep" / "1" / "model.onnx").write_bytes(b"1")
    os.symlink(outside / "v2", models / "deep" / "1" / "assets")
    assert look(models, "deep")[1] is True


def _link(link: Path, target: Path) -> Path:
    os.symlink(target, link)
    return link


@pytest.mark.parametrize(
    ("event", "touched"),
    [
        (FileModifiedEvent("/models/m/1/model.onnx"), [("m", False)]),
        (FileMovedEvent("/models/m/1/.new.tmp", "/models/m/1/model.onnx"), [("m", False)]),
        (DirCreatedEvent("/models/m/2"), [("m", True)]),
        (DirMovedEvent("/models/.staging-m", "/models/m"), [("m", True)]),
        (DirMovedEvent("/models/old", "/models/new"), [("old", True), ("new", True)]),
        (DirCreatedEvent("/models/.staging-m/1"), []),
    ],
)
async def test_a_folder_made_or_moved_in_asks_for_the_watch_to_be_renewed(
    event: FileSystemEvent, touched: list[tuple[str, bool]]
) -> None:
    seen: list[tuple[str, bool]] = []
    handler = _Handler(ROOT, asyncio.get_running_loop(), lambda n, f, _: seen.append((n, f)))
    handler.dispatch(event)
    await asyncio.sleep(0)  # the handler hands over with call_soon_threadsafe
    assert seen == touched


async def test_a_stray_file_in_the_models_folder_touches_no_model(tmp_path: Path) -> None:
    """A storm of stray files made and deleted there (16,000 in 3 s) made as many models to
    look for. A file there is a model only as a lone model file; a path gone, only for a
    model already known (it may have been a link to that model's folder)."""
    seen: list[tuple[str, bool]] = []
    handler = _Handler(
        tmp_path, asyncio.get_running_loop(), lambda n, _, known: seen.append((n, known))
    )
    (tmp_path / "junk1.txt").write_text("x")
    (tmp_path / "plain.onnx").write_text("x")
    os.symlink(tmp_path, tmp_path / "linked")  # a link to a folder: a model's folder
    for event in (
        FileCreatedEvent(str(tmp_path / "junk1.txt")),
        FileCreatedEvent(str(tmp_path / "plain.onnx")),
        FileCreatedEvent(str(tmp_path / "linked")),
        FileDeletedEvent(str(tmp_path / "junk2.txt")),
        FileDeletedEvent(str(tmp_path / "gone-link")),
    ):
        handler.dispatch(event)
    await asyncio.sleep(0)  # the handler hands over with call_soon_threadsafe
    assert seen == [
        ("plain", False),
        ("linked", False),
        ("junk2.txt", True),  # only if a model of that name is known
        ("gone-link", True),
    ]
