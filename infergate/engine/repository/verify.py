"""Verify a model file before it may serve: its SHA256 (recorded, and matched against a
pin), and a detached ed25519 signature from a trusted key when the profile demands one.

A signature covers the file's SHA256 digest, prefixed with a context string so that a
signature made for something else cannot pass as a model signature:
    ed25519_sign(key, b"infergate-model-v1:" + sha256(file))
The .sig file holds the 64 signature bytes in base64.

Model files and signatures are read only when they are regular files (a FIFO or a device
would hang the reading thread), and a signature only up to a few kilobytes. What passed is
what serves: `VerifiedStore` copies the bytes while hashing them into a read-only,
content-addressed folder the gateway owns, the checks run on the copy's digest, and workers
load the copy, so replacing the file on disk afterwards changes nothing that serves.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infergate.errors import ConfigError
from infergate.errors import NoRoom as NoRoom  # raised here
from infergate.errors import VerificationFailed as VerificationFailed  # raised here

# cryptography (25 ms of CPU to import) only where a key is made, read or used: every
# gateway imports this module, and most trust no key.
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

CONTEXT = b"infergate-model-v1:"
_CHUNK = 1 << 20
MAX_SIGNATURE_BYTES = 4096  # a signature is 88 bytes of base64; anything huge is not one


@dataclass(frozen=True)
class TrustedKey:
    name: str
    key: Ed25519PublicKey


def open_regular(path: Path) -> int:
    """An fd for reading `path`, which must be a regular file (a symlink to one is fine).
    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else ("a device or socket")
        )
        raise VerificationFailed(
            f"{path} is {kind}, not a regular file; it is not read. Hint: put the file itself "
            "there (a symlink to a regular file is fine)"
        )
    os.set_blocking(fd, True)
    return fd


def sha256_file(path: Path) -> str:
    """The file's SHA256, of the size it had when opened and no more: a file grown as it
    was hashed (to 4 TiB, sparse) held a disk thread for hours. One whose size changed
    meanwhile is refused."""
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        size = left = os.fstat(f.fileno()).st_size
        while left and (chunk := f.read(min(_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
        now = os.fstat(f.fileno()).st_size
    if left or now != size:
        raise changed_size(path, size, now)
    return digest.hexdigest()


def changed_size(path: Path, before: int, after: int) -> VerificationFailed:
    return VerificationFailed(
        f"{path} changed size while it was read ({before:,} bytes, then {after:,}); it is "
        "read again once it has settled. Hint: write a model file elsewhere and move it "
        "into place"
    )


def read_signature(sig_file: Path) -> bytes:
    with os.fdopen(open_regular(sig_file), "rb") as f:
        raw = f.read(MAX_SIGNATURE_BYTES + 1)
    if len(raw) > MAX_SIGNATURE_BYTES:
        raise VerificationFailed(
            f"{sig_file} is larger than {MAX_SIGNATURE_BYTES} bytes, so it is not a signature "
            "(one is 88 bytes of base64). Hint: infergate model sign writes one"
        )
    return raw


def signature_path(model_file: Path) -> Path:
    return model_file.with_name(model_file.name + ".sig")


def generate_key(private_path: Path) -> Path:
    """Write a new private key (PEM, mode 0600) and its public key beside it (.pub)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a readable unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path}: not an ed25519 key. Hint: make one with infergate model keygen")
    return key


def load_public_key(path: Path) -> TrustedKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

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
    from cryptography.exceptions import InvalidSignature

    sig_file = signature_path(model_file)
    try:
        raw = read_signature(sig_file)
    except FileNotFoundError:
        raise VerificationFailed(
            f"{model_file} is not signed and the profile requires signed models. "
            f"Hint: infergate model sign {model_file} --key KEY"
        ) from None
    try:
        signature = base64.b64decode(raw.strip(), validate=True)
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
    check_digest(model_file, sha, pinned_sha256, policy)
    return sha


# A file's identity and times as stat gives them: equal, its bytes are those hashed.
_Stamp = tuple[int, int, int, int, int]


class Digests:
    """SHA256s of files by what stat says of them, so that a sync does not hash a file
    that did not change again (a 10 GB model was read whole on every event in its folder,
    to find it unchanged). A stamp is trusted only for a file whose times were SETTLED_NS
    old when it was hashed: a write in the clock tick of the one before leaves them as
    they were (git's "racily clean" entries). The digests are those of the copies
    (VerifiedStore.admit hashes a file as it copies it): this only decides whether a
    file changed."""

    SETTLED_NS = 2_000_000_000
    MAX_FILES = 4096

    def __init__(self) -> None:
        self._known: dict[Path, tuple[_Stamp, str]] = {}
        self._lock = threading.Lock()  # (the registry's disk threads remember at once)

    def cached(self, model_file: Path) -> str | None:
        """The file's SHA256 when its stamp is the one it had when hashed; else None (it
        is not read)."""
        known = self._known.get(model_file)
        if known is None:
            return None
        try:
            st = os.stat(model_file)
        except OSError:
            return None
        return known[1] if known[0] == _stamp(st) else None

    def remember(
        self,
        model_file: Path,
        before: os.stat_result,
        after: os.stat_result,
        sha: str,
        hashed_at: int,
    ) -> None:
        """`sha`, hashed at `hashed_at` (ns) from a read between two stats of the file:
        trusted for that stamp while the stamp stays, if it did not change meanwhile and
        the file's times were settled when it was read."""
        stamp = _stamp(before)
        with self._lock:
            self._known.pop(model_file, None)
            if stamp != _stamp(after):
                return
            # By ctime alone, which the kernel sets at every change: an mtime set years
            # ahead (utime) kept a file from ever being trusted, and it was hashed whole at
            # every sync (every 10 s, when a retry for room came).
            if hashed_at - before.st_ctime_ns >= self.SETTLED_NS:
                if len(self._known) >= self.MAX_FILES:  # (the oldest go first)
                    del self._known[next(iter(self._known))]
                self._known[model_file] = (stamp, sha)


def _stamp(st: os.stat_result) -> _Stamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_digest(
    model_file: Path, sha: str, pinned_sha256: str | None, policy: VerifyPolicy
) -> None:
    """The pin and the signature checks, on a digest already computed."""
    if pinned_sha256 is not None and pinned_sha256.lower() != sha:
        raise VerificationFailed(
            f"{model_file} has SHA256 {sha} but model.toml pins {pinned_sha256}. Hint: update "
            "the pin if the new file is intended"
        )
    if policy.require_signed:
        check_signature(model_file, sha, list(policy.trusted_keys))


_STORE_PREFIX = "infergate-verified-"


def _hold(folder: Path) -> int | None:
    """An fd holding an exclusive BSD lock on the directory `folder` (None: another
    process holds one). A store's gateway holds its store's for its life; the lock goes
    with the process (however it ends), so a store nobody holds is an orphan. A pid would
    not tell: one in another PID namespace sharing /tmp looks dead. systemd-tmpfiles
    leaves a locked directory alone too (tmpfiles.d(5)), however old its files."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _alive(pid: str) -> bool:
    """Whether the process `pid` (a store's name's) is alive in this PID namespace."""
    if not (pid.isascii() and pid.isdigit() and len(pid) < 10):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # alive, not ours to signal
    return True


def _remove_orphans() -> None:
    """Stores of gateways that were killed (so never removed theirs): nobody holds them,
    and their pid is gone (a gateway of an older release takes no lock)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{_STORE_PREFIX}*-*"):
        if _alive(folder.name[len(_STORE_PREFIX) :].split("-", 1)[0]):
            continue
        try:
            fd = _hold(folder)
        except OSError:
            continue  # not a directory, or not ours to read
        if fd is not None:
            shutil.rmtree(folder, ignore_errors=True)
            os.close(fd)


# What a copy leaves free on the store's file system, at least: a model file that would
# fill it (a sparse 100 GB file takes no room in the repository, all of it as a copy) is
# refused before a byte is copied, and the machine keeps room for its logs and the rest.
# A twentieth of a small file system (a tmpfs /tmp on a small host) instead.
STORE_RESERVE_BYTES = 1 << 30


def _check_room(source: Path, stat_result: os.stat_result, fd: int, coming: int = 0) -> None:
    """Refuse to copy `source` (`stat_result`) to the file system of `fd` without room,
    `coming` bytes of other copies under way being as good as written."""
    fs = os.fstatvfs(fd)
    free = fs.f_bavail * fs.f_frsize - coming
    reserve = min(STORE_RESERVE_BYTES, fs.f_blocks * fs.f_frsize // 20)
    size = stat_result.st_size
    if size > free - reserve:
        sparse = stat_result.st_blocks * 512 < size // 2
        raise NoRoom(
            f"{source} holds {size / 2**20:,.0f} MiB{' (sparse)' if sparse else ''}, and the "
            f"verified copies' file system has {free / 2**20:,.0f} MiB free, of which "
            f"{reserve / 2**20:,.0f} MiB is kept free. Hint: free room in "
            f"{tempfile.gettempdir()} or set TMPDIR to a larger file system"
        )


class VerifiedStore:
    """Read-only copies of verified model files, by content: `root/<sha256>/<file name>`.

    `admit` copies a file while hashing it (one read of the source, so the digest is that
    of the copy's bytes) and runs the checks on that digest; workers get the copy. Copies
    are counted per user and removed when the last one releases them. Thread-safe: the
    copying runs in worker threads."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root
        self._held: int | None = None  # the lock on a store made here (`_hold`)
        self._users: dict[Path, int] = {}
        self._coming = 0  # bytes of the copies under way
        self._lock = threading.Lock()

    @property
    def root(self) -> Path:
        with self._lock:
            if self._root is None:
                _remove_orphans()
                # Made under a hidden name, which no sweep looks at, and locked before it
                # takes its name: another gateway's sweep never finds it unheld.
                made = Path(tempfile.mkdtemp(prefix=f".{_STORE_PREFIX}{os.getpid()}-"))
                self._held = _hold(made)
                assert self._held is not None, "a directory just made is held by nobody"
                root = made.with_name(made.name[1:])
                os.rename(made, root)
                self._root = root
            return self._root

    def admit(
        self, source: Path, pinned_sha256: str | None, policy: VerifyPolicy
    ) -> tuple[str, Path]:
        """(sha256, path of the read-only copy) once every check passed on the copy."""
        root = self.root
        digest = hashlib.sha256()
        fd, tmp_name = tempfile.mkstemp(dir=root, prefix=".incoming-")
        tmp = Path(tmp_name)
        try:
            # (The copy first: a source that cannot be opened leaked its fd.)
            with os.fdopen(fd, "wb") as dst, os.fdopen(open_regular(source), "rb") as src:
                st = os.fstat(src.fileno())
                # Two copies at once each saw the room for one: what a copy under way has
                # still to write counts as written (what it wrote is gone from the room).
                with self._lock:
                    _check_room(source, st, dst.fileno(), self._coming)
                    self._coming += st.st_size
                left = st.st_size
                try:
                    # Its size when the room was checked, no more: a file that grew as it
                    # was copied filled the copies' file system past the check, and a
                    # "regular" file that never ends (/proc/kmsg) held a disk thread.
                    while left and (chunk := src.read(min(_CHUNK, left))):
                        digest.update(chunk)
                        dst.write(chunk)
                        with self._lock:
                            self._coming -= len(chunk)
                        left -= len(chunk)
                finally:
                    with self._lock:
                        self._coming -= left
                now = os.fstat(src.fileno()).st_size
                if left or now != st.st_size:
                    raise changed_size(source, st.st_size, now)
            sha = digest.hexdigest()
            check_digest(source, sha, pinned_sha256, policy)
            folder = root / sha
            target = folder / source.name
            # The folder is made, filled and (in release) emptied and removed under one
            # lock: two models with the same bytes share it, and a mkdir that found it
            # while a release removed it failed the load ("File exists", or the copy's
            # move found no folder).
            with self._lock:
                folder.mkdir(mode=0o755, exist_ok=True)
                if target.exists():
                    tmp.unlink()  # the same bytes are already there
                else:
                    os.chmod(tmp, 0o444)
                    os.replace(tmp, target)
                self._users[target] = self._users.get(target, 0) + 1
            return sha, target
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def release(self, path: Path) -> None:
        """One user of `path` is done with it; the last one removes the copy."""
        with self._lock:
            users = self._users.get(path, 0) - 1
            if users > 0:
                self._users[path] = users
                return
            self._users.pop(path, None)
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other names with the same bytes remain
                path.parent.rmdir()

    def close(self) -> None:
        with self._lock:
            root, self._root = self._root, None
            held, self._held = self._held, None
            self._users.clear()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        if held is not None:
            os.close(held)
