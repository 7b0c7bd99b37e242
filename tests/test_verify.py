"""SHA256 pins and ed25519 signatures."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from infergate.engine.repository.verify import (
    VerificationFailed,
    VerifyPolicy,
    generate_key,
    load_private_key,
    load_public_key,
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
