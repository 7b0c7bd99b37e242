"""A copies' file system without room, for the verified store's tests."""

from __future__ import annotations

import os

import pytest


def fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The copies' file system says no block is free (os.fstatvfs), while the list's one
    value stays True."""
    real = os.fstatvfs
    full = [True]

    def statvfs(fd: int) -> os.statvfs_result:
        fields = list(real(fd))
        if full[0]:
            fields[4] = 0  # no block free
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "fstatvfs", statvfs)
    return full
