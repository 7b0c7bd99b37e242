"""A process's name in ps and top (Linux's PR_SET_NAME): a forked or helper process's
command line is its parent's, so its name is what tells them apart."""

from __future__ import annotations

import contextlib
import ctypes

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def prctl(option: int, value: int | bytes) -> None:
    """Linux's prctl(option, value); nothing elsewhere, or where the call is refused."""
    with contextlib.suppress(OSError, AttributeError):  # Linux only: a nicety
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def set_name(name: bytes) -> None:
    """This process's name (up to 15 bytes are kept)."""
    prctl(PR_SET_NAME, name)
