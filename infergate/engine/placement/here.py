"""The CPU the calling thread runs on now, to hand a lone request to the worker pinned to
that core: the kernel then wakes the worker on the gateway's own core, which goes idle as
the gateway waits, instead of waking the other core. On a VM, waking an idle vCPU costs
tens of µs, each way of the trip: at concurrency 1, choosing the worker on the gateway's
core took the time from a batch leaving the queue to its reply being read from 263 to
221 µs, and the p50 down by 11% (`benchmarks/http_cpu.py --c1`)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _sched_getcpu() -> Callable[[], int] | None:
    try:
        # PyDLL, not CDLL: a CDLL call lets go of the GIL, and any other thread waiting
        # for it (the watcher, the decoder's I/O) would then run before the loop goes on.
        call = ctypes.PyDLL(None).sched_getcpu  # glibc and musl; 80 ns a call
    except (OSError, AttributeError):  # not Linux
        return None
    call.restype, call.argtypes = ctypes.c_int, []
    return call


_GETCPU = _sched_getcpu()


def current_cpu() -> int | None:
    """This thread's CPU now (it may move at any time: a hint), or None where unknown."""
    if _GETCPU is None:
        return None
    cpu = _GETCPU()
    return cpu if cpu >= 0 else None
