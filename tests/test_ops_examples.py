"""scripts/make_examples.py makes the committed example models and samples byte for byte,
whatever the hash seed: so pinned SHA256s and signatures of them stay valid."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

FILES = [
    "models/digits/1/model.onnx",
    "models/encoder/1/model.pt",
    "models/encoder/model.toml",
    "examples/digit-7.npy",
    "examples/features.npy",
]


@pytest.mark.slow
def test_make_examples_reproduces_the_committed_files(tmp_path: Path) -> None:
    for needed in ("skl2onnx", "torch"):  # the script's; found, not imported (6 s of CPU)
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"{needed} is not installed")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # the script pins its own
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_examples.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        env=env,
        timeout=300,
    )
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (REPO / name).read_bytes(), name


@pytest.mark.slow
def test_building_the_package_warns_of_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "deprecated" not in (done.stdout + done.stderr).lower()


def test_gitignore_keeps_private_keys_out() -> None:
    done = subprocess.run(
        ["git", "check-ignore", "-v", "signing.key", "models/x/private.key"],
        cwd=REPO, check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)
