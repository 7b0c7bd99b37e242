"""What a model's files look like on disk: a snapshot of each file that makes it up (path,
size, mtime, inode), and whether any of its paths is a symlink. The watcher compares
snapshots to tell when a model's files have settled, and looks at models again when no
event would tell of a change (behind a link, or with the folder unwatched)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from infergate.engine.repository.scan import is_ignored
from infergate.engine.runtimes import model_suffixes

log = logging.getLogger("infergate.watcher")
Row = tuple[str, int, int, int]  # a file's path (from the models folder), size, mtime, inode
Snapshot = tuple[Row, ...]


def _stat_row(path: Path, name: str, rows: list[Row]) -> bool:
    """Add `path`'s row (through a link) to `rows`; whether `path` is a link. One lstat for
    a path that is not there (most of the lone files looked for) or is no link."""
    linked = False
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            linked = True  # (a dangling one too: its target may come back)
            st = os.stat(path)
    except FileNotFoundError:
        return linked
    except OSError as exc:  # a symlink loop, no permission: skip it, say so once per look
        log.warning("watcher: cannot look at %s (%s); skipped", path, exc.strerror or exc)
        return linked
    # The inode too: a link swapped to another file of the same size and mtime (weights
    # unpacked by tar, `cp -a`, an image layer) is another file all the same.
    rows.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return linked


# Folders a model's snapshot looks into below its own (its versions' are the first):
# a file deeper is none of the model's (a loader reads its version's files and their
# external data beside them). A walk's cost grows with the square of a tree's depth (each
# path is resolved from the top): a tenant's 2,000 nested folders cost 4.5 s a look.
LOOK_DEPTH = 8


def snapshot(root: Path, name: str) -> Snapshot:
    """Size, mtime and inode of every file that makes up model `name`."""
    return look(root, name)[0]


def look(root: Path, name: str) -> tuple[Snapshot, bool]:
    """`snapshot`, and whether any of the model's paths is a symlink: then its files may
    change outside the models folder, where no event tells (`RepositoryWatcher` looks at
    such a model again every CHECK_S). A version folder that is a link is looked into (one
    level: its files), as the scan reads it."""
    rows: list[Row] = []
    folder = root / name
    linked = folder.is_symlink()  # (a dangling one too: its target may come back)
    if folder.is_dir():
        top = len(folder.parts)
        for dirpath, dirnames, filenames in os.walk(folder):
            here = Path(dirpath)
            if len(here.parts) - top >= LOOK_DEPTH:
                dirnames[:] = []  # deeper is no model's: see LOOK_DEPTH
            dirnames[:] = [d for d in dirnames if not is_ignored(Path(d))]
            # os.walk does not follow the links among its folders: a version folder's
            # files are read through one, so they are in the snapshot (one level).
            for linked_dir in [here / d for d in dirnames if _is_link(here / d)]:
                linked = True
                if here == folder:
                    _linked_folder_rows(root, linked_dir, rows)
            for filename in filenames:
                if is_ignored(Path(filename)):
                    continue
                path = here / filename
                linked = _stat_row(path, str(path.relative_to(root)), rows) or linked
    for suffix in model_suffixes():
        for path in (root / f"{name}{suffix}", root / f"{name}{suffix}.sig"):
            linked = _stat_row(path, path.name, rows) or linked
    return tuple(sorted(rows)), linked


def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:  # gone, or a path past PATH_MAX in a tree that deep: not one to follow
        return False


def _linked_folder_rows(root: Path, folder: Path, rows: list[Row]) -> None:
    try:
        entries = sorted(os.listdir(folder))
    except OSError as exc:  # a dangling link, a loop, no permission: skipped, as a file is
        log.warning("watcher: cannot look at %s (%s); skipped", folder, exc.strerror or exc)
        return
    for entry in entries:
        path = folder / entry
        if not is_ignored(path) and not path.is_dir():
            _stat_row(path, str(path.relative_to(root)), rows)
