"""scripts/choose_python.py: install.sh makes .venv with the fastest build of python3's
version on the machine, and only with one that is clearly faster."""

from __future__ import annotations

import importlib.util
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
    assert chosen == debian
    assert "1.4 times as fast" in why


def test_python3_is_kept_unless_another_is_15_percent_faster(tmp_path: Path) -> None:
    default, other = interpreters(tmp_path, "pyenv", "other")
    times = {default: 1.0, other: 0.9}
    chosen, _ = choose_python.choose(default, [other], lambda p: "3.11", times.get)
    assert chosen == default


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
    assert set(timed) == {default}  # neither was even timed


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
    assert (chosen, timed) == (default, [default])


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
    version = subprocess.run(
        [chosen, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() == str(sys.version_info[:2])
