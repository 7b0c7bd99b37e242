"""Verify a model file before it may serve: its SHA256 (recorded, and matched against a
pin), and a detached ed25519 signature from a trusted key when the profile demands one.

A signature covers the file's SHA256 digest, prefixed with a context string so that a
signature made for something else cannot pass as a model signature:
    ed25519_sign(key, b"infergate-model-v1:" + sha256(file))
The .sig file holds the 64 signature bytes in base64.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from infergate.errors import ConfigError

CONTEXT = b"infergate-model-v1:"
_CHUNK = 1 << 20


class VerificationFailed(Exception):
    """The file may not serve; the message says why and how to fix it."""


@dataclass(frozen=True)
class TrustedKey:
    name: str
    key: Ed25519PublicKey


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def signature_path(model_file: Path) -> Path:
    return model_file.with_name(model_file.name + ".sig")


def generate_key(private_path: Path) -> Path:
    """Write a new private key (PEM, mode 0600) and its public key beside it (.pub)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path = private_path.with_name(private_path.name + ".pub")
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a readable unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path}: not an ed25519 key. Hint: make one with infergate model keygen")
    return key


def load_public_key(path: Path) -> TrustedKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{path}: not an ed25519 public key")
    return TrustedKey(path.name, key)


def sign_file(model_file: Path, key: Ed25519PrivateKey) -> Path:
    digest = bytes.fromhex(sha256_file(model_file))
    signature = key.sign(CONTEXT + digest)
    out = signature_path(model_file)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(base64.b64encode(signature) + b"\n")
    tmp.replace(out)  # atomic: a watcher never sees half a signature
    return out


def check_signature(model_file: Path, sha256: str, keys: list[TrustedKey]) -> str:
    """The name of the trusted key that signed the file; raises VerificationFailed."""
    sig_file = signature_path(model_file)
    if not sig_file.exists():
        raise VerificationFailed(
            f"{model_file} is not signed and the profile requires signed models. "
            f"Hint: infergate model sign {model_file} --key KEY"
        )
    try:
        signature = base64.b64decode(sig_file.read_bytes().strip(), validate=True)
    except ValueError:
        raise VerificationFailed(f"{sig_file} is not a base64 signature") from None
    message = CONTEXT + bytes.fromhex(sha256)
    for trusted in keys:
        try:
            trusted.key.verify(signature, message)
            return trusted.name
        except InvalidSignature:
            continue
    raise VerificationFailed(
        f"{sig_file} does not verify against any trusted key "
        f"({', '.join(k.name for k in keys) or 'none configured'}): the file changed after "
        "signing, or it was signed with another key"
    )


@dataclass(frozen=True)
class VerifyPolicy:
    require_signed: bool = False
    trusted_keys: tuple[TrustedKey, ...] = ()


def verify_file(model_file: Path, pinned_sha256: str | None, policy: VerifyPolicy) -> str:
    """SHA256 of the file after every check passed; raises VerificationFailed."""
    sha = sha256_file(model_file)
    if pinned_sha256 is not None and pinned_sha256.lower() != sha:
        raise VerificationFailed(
            f"{model_file} has SHA256 {sha} but model.toml pins {pinned_sha256}. Hint: update "
            "the pin if the new file is intended"
        )
    if policy.require_signed:
        check_signature(model_file, sha, list(policy.trusted_keys))
    return sha
