"""scripts/choose_python.py: install.sh makes .venv with the fastest build of python3's
version on the machine, and only with one that is clearly faster."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "choose_python", REPO / "scripts" / "choose_python.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


choose_python = _load()


def interpreters(tmp_path: Path, *names: str) -> list[str]:
    """Executable files standing for interpreters (their versions and times are faked)."""
    paths = []
    for name in names:
        path = tmp_path / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        paths.append(str(path))
    return paths


def test_a_clearly_faster_build_of_the_same_version_is_chosen(tmp_path: Path) -> None:
    default, debian = interpreters(tmp_path, "pyenv", "debian")
    times = {default: 1.0, debian: 0.7}
    chosen, why = choose_python.choose(default, [debian], lambda p: "3.11", times.get)
    assert (chosen, why) == (
        debian,
        f"1.4 times as fast on a short loop as python3, {default}, the same Python 3.11; "
        f"to use python3: rm -r .venv && PYTHON={default} ./install.sh",
    )


def test_python3_is_kept_unless_another_is_15_percent_faster(tmp_path: Path) -> None:
    default, other = interpreters(tmp_path, "pyenv", "other")
    times = {default: 1.0, other: 0.9}
    chosen, why = choose_python.choose(default, [other], lambda p: "3.11", times.get)
    assert (chosen, why) == (
        default,
        "python3; no other build of Python 3.11 took 15% less time on a short loop: "
        f"{other} took 0.90 times as long",
    )  # the build passed over, and by how much, show


def test_python3_is_kept_and_says_so_where_it_is_the_only_build(tmp_path: Path) -> None:
    (default,) = interpreters(tmp_path, "pyenv")
    chosen, why = choose_python.choose(
        default, [str(tmp_path / "absent")], lambda p: "3.11", {}.get
    )
    assert (chosen, why) == (default, "python3; no other build of Python 3.11 here")


def test_other_versions_and_builds_without_venv_are_passed_over(tmp_path: Path) -> None:
    default, newer, no_venv = interpreters(tmp_path, "pyenv", "py312", "no-venv")
    versions = {default: "3.11", newer: "3.12", no_venv: None}
    times = {default: 1.0, newer: 0.1, no_venv: 0.1}
    timed: list[str] = []

    def seconds(path: str) -> float:
        timed.append(path)
        return times[path]

    chosen, _ = choose_python.choose(default, [newer, no_venv], versions.get, seconds)
    assert chosen == default
    assert timed == []  # neither was even timed (nor python3: nothing to choose between)


def test_each_keeps_its_best_pass_so_one_slow_pass_does_not_choose(tmp_path: Path) -> None:
    default, other = interpreters(tmp_path, "pyenv", "other")
    passes = {default: iter([3.0, 1.0, 1.0]), other: iter([0.95, 0.95, 0.95])}
    chosen, _ = choose_python.choose(
        default, [other], lambda p: "3.11", lambda p: next(passes[p]), passes=3
    )
    assert chosen == default


def test_missing_or_duplicate_candidates_are_skipped(tmp_path: Path) -> None:
    (default,) = interpreters(tmp_path, "pyenv")
    link = tmp_path / "python3.11"
    link.symlink_to(default)  # the same file under another name: not timed twice
    timed: list[str] = []

    def seconds(path: str) -> float:
        timed.append(path)
        return 1.0

    chosen, _ = choose_python.choose(
        default, [str(link), str(tmp_path / "absent")], lambda p: "3.11", seconds, passes=1
    )
    assert (chosen, timed) == (default, [])  # one build only: nothing timed


def test_the_script_names_an_interpreter_of_the_same_version() -> None:
    """On this machine, for real: whatever it picks runs Python of the running version."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "choose_python.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    chosen = done.stdout.strip()
    # and always says which, and why, in one line (install.sh passes it on)
    assert done.stderr.startswith(f"install.sh: python: {chosen} (")
    assert done.stderr.count("\n") == 1, done.stderr
    version = subprocess.run(
        [chosen, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() == str(sys.version_info[:2])


STUB = """#!/bin/sh
# Stands for python: `-m venv DIR` makes DIR/bin/python (this stub); all else succeeds.
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
exit 0
"""


def _install(tmp_path: Path, env: dict[str, str]) -> list[str]:
    """install.sh, copied into `tmp_path` (it works where it lies), run with `python`
    stubbed: the lines that say which python."""
    shutil.copy(REPO / "install.sh", tmp_path / "install.sh")
    done = subprocess.run(
        ["bash", str(tmp_path / "install.sh"), "--cpu"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": os.environ["PATH"], **env},
    )
    return [line for line in done.stdout.splitlines() if line.startswith("install.sh: python:")]


def test_install_sh_says_which_python_it_uses_and_why(tmp_path: Path) -> None:
    """One line, whichever way the interpreter is chosen: PYTHON=, or a .venv made before
    (kept, with what made it, even when PYTHON= names another)."""
    stub = tmp_path / "python-stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    assert _install(tmp_path, {"PYTHON": str(stub)}) == [
        f"install.sh: python: {stub} (from PYTHON)"
    ]
    (tmp_path / ".venv" / "pyvenv.cfg").write_text(
        "home = /usr/bin\nversion = 3.11.2\nexecutable = /usr/bin/python3.11\n"
    )
    kept = (
        "install.sh: python: /usr/bin/python3.11 (.venv's, made before, kept{}; rm -r .venv "
        "and run this again to choose anew)"
    )
    assert _install(tmp_path, {}) == [kept.format("")]
    assert _install(tmp_path, {"PYTHON": "/opt/python3.12"}) == [
        kept.format(", not PYTHON=/opt/python3.12")
    ]
