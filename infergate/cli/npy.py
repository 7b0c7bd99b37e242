"""Reading .npy and .npz files given on the command line: a bad file is one clear line
(a usage error), never a traceback, and never unpickled."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import typer

from infergate.tensors import Array

HINT = "Hint: save it with numpy.save(path, array) from a numeric or string array"


def _regular(path: Path) -> None:
    if not path.exists():
        raise typer.BadParameter(f"{path}: no such file")
    if not path.is_file():  # a directory, or a FIFO that would wait for a writer
        raise typer.BadParameter(f"{path}: not a regular file (a directory, a FIFO?)")


def load_npy(path: Path) -> Array:
    _regular(path)
    try:
        array: Array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "pickle" in str(exc):
            raise typer.BadParameter(
                f"{path}: holds Python objects (a pickled array), which infergate never "
                f"loads: unpickling runs code. {HINT}"
            ) from None
        raise typer.BadParameter(f"{path}: not a readable .npy file ({exc}). {HINT}") from None
    except (OSError, EOFError) as exc:
        raise typer.BadParameter(f"{path}: not a readable .npy file ({exc}). {HINT}") from None
    if not isinstance(array, np.ndarray):
        raise typer.BadParameter(f"{path}: an .npz archive, not a .npy array")
    return array


def load_npz(path: Path) -> dict[str, Array]:
    _regular(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise typer.BadParameter(
            f"{path}: not a readable .npz archive of plain arrays ({exc}). Hint: "
            "numpy.savez(path, input_name=array, ...)"
        ) from None


def sendable(what: str, array: Array) -> Array:
    """`array` when a V2 tensor can carry it; a usage error naming `what` when not (a
    complex, structured or datetime array has no V2 datatype)."""
    from infergate.tensors import v2_datatype

    try:
        v2_datatype(array.dtype)
    except ValueError as exc:
        raise typer.BadParameter(
            f"{what}: {exc}. Hint: numbers (int, uint, float), booleans or strings"
        ) from None
    return array
