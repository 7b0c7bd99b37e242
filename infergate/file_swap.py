"""A file replaced whole or not at all: written beside it, then renamed over it. What
reads the path sees the old file or the new one, never half of one; a symlink or FIFO
standing at the path is replaced, not written through or opened."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def swapped_in(path: Path, mode: int | None = None) -> Iterator[tuple[BinaryIO, Path]]:
    """A new file beside `path` and its path (in `path`'s form, relative if it is), to
    write and check: renamed over `path` when the block ends, removed if it raises.

    Its name is of its own length, whatever `path`'s (a name as long as a file name may be
    still has room beside it). Its mode: `mode`, else that of the regular file it
    replaces, else what a plain open gives (0666 less the umask)."""
    fd, part = _new_beside(path)
    try:
        with os.fdopen(fd, "wb") as file:
            kept = mode
            if kept is None:
                with contextlib.suppress(FileNotFoundError):
                    there = os.lstat(path)
                    if stat.S_ISREG(there.st_mode):
                        kept = there.st_mode & 0o777
            if kept is not None:
                with contextlib.suppress(OSError):  # (a filesystem without modes)
                    os.fchmod(file.fileno(), kept)
            yield file, part
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


def _new_beside(path: Path) -> tuple[int, Path]:
    """A file created in `path`'s folder (O_EXCL, O_NOFOLLOW: never one that stood
    there), with the mode a plain open gives."""
    for _ in range(100):
        part = path.parent / f".infergate-{secrets.token_hex(8)}.part"
        try:
            return os.open(part, _FLAGS, 0o666), part
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {path.parent}")
