"""SHA256 pins and ed25519 signatures."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from infergate.engine.repository.verify import (
    Digests,
    VerificationFailed,
    VerifyPolicy,
    generate_key,
    load_private_key,
    load_public_key,
    sha256_file,
    sign_file,
    verify_file,
)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"pretend onnx bytes")
    return path


def test_sha256_is_recorded_and_a_pin_must_match(model_file: Path) -> None:
    sha = hashlib.sha256(model_file.read_bytes()).hexdigest()
    assert verify_file(model_file, None, VerifyPolicy()) == sha
    assert verify_file(model_file, sha.upper(), VerifyPolicy()) == sha
    with pytest.raises(VerificationFailed, match="but model.toml pins 00"):
        verify_file(model_file, "00" * 32, VerifyPolicy())


def test_signatures(model_file: Path, tmp_path: Path) -> None:
    pub = generate_key(tmp_path / "team.key")
    assert (tmp_path / "team.key").stat().st_mode & 0o777 == 0o600
    other_pub = generate_key(tmp_path / "other.key")
    policy = VerifyPolicy(require_signed=True, trusted_keys=(load_public_key(pub),))
    with pytest.raises(VerificationFailed, match="is not signed"):
        verify_file(model_file, None, policy)
    sign_file(model_file, load_private_key(tmp_path / "team.key"))
    verify_file(model_file, None, policy)
    model_file.write_bytes(b"tampered")
    with pytest.raises(VerificationFailed, match="does not verify against any trusted key"):
        verify_file(model_file, None, policy)
    sign_file(model_file, load_private_key(tmp_path / "other.key"))
    with pytest.raises(VerificationFailed, match=r"\(team.key.pub\)"):
        verify_file(model_file, None, policy)
    both = VerifyPolicy(True, (load_public_key(pub), load_public_key(other_pub)))
    verify_file(model_file, None, both)


def test_a_file_is_hashed_at_the_size_it_had_when_opened() -> None:
    """A hash read to the end of its file: one grown as it was hashed (to 4 TiB, sparse)
    held a disk thread for hours, and a "regular" file of size 0 that never ends
    (/proc/kmsg) for good. /proc/self/status says size 0 and reads a page."""
    assert sha256_file(Path("/proc/self/status")) == hashlib.sha256(b"").hexdigest()


def test_a_file_whose_mtime_is_set_ahead_is_trusted_once_its_ctime_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's times had to be settled to trust its digest, mtime included: an mtime set
    ten years ahead kept it from ever being trusted, and it was hashed whole at every sync.
    Its ctime, which the kernel sets at every change, tells alone."""
    model = tmp_path / "model.onnx"
    model.write_bytes(b"weights")
    ahead = time.time_ns() + 10 * 365 * 86400 * 10**9
    os.utime(model, ns=(ahead, ahead))
    monkeypatch.setattr(Digests, "SETTLED_NS", 0)  # (its ctime is now: it cannot be set back)
    digests = Digests()
    st = os.stat(model)
    digests.remember(model, st, st, "abc", time.time_ns())
    assert digests.cached(model) == "abc"
