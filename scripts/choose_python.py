"""Which Python `install.sh` makes `.venv` with: the fastest build of python3's version here.

    python3 scripts/choose_python.py      # prints the interpreter's path; which and why,
                                          # one line on stderr

The gateway's request path is pure Python on one event loop, so the interpreter's build
sets its CPU per request, and builds of the same version differ: pyenv's default build
(no PGO or LTO, a shared libpython) ran the gateway's tiny requests at about 1.3 times the
CPU of Debian's /usr/bin/python3.11, a PGO and LTO build like the python:3.11 images
`deploy/Dockerfile` starts from (README, "Performance"). So this times a short loop of
calls, objects and dicts on python3 and on the other interpreters of the same X.Y that
the usual places hold, and picks one only when it is clearly faster (15%: timing noise
never moves the choice). The same X.Y only, so that the same wheels, and torch's file,
apply; one that cannot make a venv (Debian without python3-venv) is passed over.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable

CLEARLY_FASTER = 0.85  # a candidate's loop time over python3's, at most, to be chosen
PASSES = 3  # each interpreter is timed this many times, in turn

# CPU seconds of a small loop on the interpreter that runs it, best of 5: process time,
# so that a busy machine's waits for a core do not count.
LOOP = """
import time
class Point:
    __slots__ = ("x", "y")
    def __init__(self, x, y):
        self.x, self.y = x, y
def loop():
    d = {}
    for i in range(150_000):
        p = Point(i, str(i & 7))
        d[i & 1023] = (p.x, p.y)
times = []
for _ in range(5):
    start = time.process_time()
    loop()
    times.append(time.process_time() - start)
print(min(times))
"""
PROBE = "import sys, venv, ensurepip; print('{}.{}'.format(*sys.version_info[:2]))"


def candidates(version: str, which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """Where other builds of Python `version` usually are: the distribution's, a local
    build's, and the first on PATH."""
    found = [f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    on_path = which(f"python{version}")
    if on_path is not None:
        found.append(on_path)
    return found


def choose(
    default: str,
    others: Iterable[str],
    version_of: Callable[[str], str | None],
    loop_seconds: Callable[[str], float | None],
    same: Callable[[str, str], bool] = os.path.samefile,
    passes: int = PASSES,
) -> tuple[str, str]:
    """The interpreter to use, and why. `version_of` is an interpreter's X.Y, or None when
    it cannot make a venv; `loop_seconds` its time for LOOP, or None when it failed. The
    interpreters are timed in turn, `passes` times, and each keeps its best time: a
    neighbour's burst of work slows one pass, not all."""
    version = version_of(default)
    if version is None:
        return default, "python3, which cannot make a venv: no other build was looked for"
    timed = [default]
    for path in others:
        if not os.access(path, os.X_OK) or any(_same(path, t, same) for t in timed):
            continue
        if version_of(path) == version:
            timed.append(path)
    if len(timed) == 1:
        return default, f"python3; no other build of Python {version} here"
    best_s: dict[str, float] = {}
    for _ in range(passes):
        for path in timed:
            s = loop_seconds(path)
            if s is not None:
                best_s[path] = min(s, best_s.get(path, s))
    base = best_s.get(default)
    if base is None:
        return default, "python3, which could not be timed"
    best = min(best_s, key=lambda p: (best_s[p], p != default))
    if best == default or best_s[best] >= CLEARLY_FASTER * base:
        runner_up = min((p for p in best_s if p != default), key=best_s.__getitem__, default=None)
        timed_too = (
            f": {runner_up} took {best_s[runner_up] / base:.2f} times as long"
            if runner_up is not None
            else ""
        )
        return default, (
            f"python3; no other build of Python {version} took {1 - CLEARLY_FASTER:.0%} less "
            f"time on a short loop{timed_too}"
        )
    return best, (
        f"{base / best_s[best]:.1f} times as fast on a short loop as python3, {default}, the "
        f"same Python {version}; to use python3: rm -r .venv && PYTHON={default} ./install.sh"
    )


def _same(a: str, b: str, same: Callable[[str, str], bool]) -> bool:
    try:
        return same(a, b)
    except OSError:
        return False


def _run(python: str, code: str) -> str | None:
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _loop_seconds(python: str) -> float | None:
    out = _run(python, LOOP)
    try:
        return float(out) if out else None
    except ValueError:
        return None


def main() -> None:
    default = sys.executable  # the real interpreter behind a shim such as pyenv's
    version = "{}.{}".format(*sys.version_info[:2])
    chosen, why = choose(default, candidates(version), lambda p: _run(p, PROBE), _loop_seconds)
    # Always one line, so that a build passed over (or a python3 kept) shows.
    print(f"install.sh: python: {chosen} ({why})", file=sys.stderr)
    print(chosen)


if __name__ == "__main__":
    main()
