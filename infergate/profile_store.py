"""The live profile: watched for edits, applied to the engine, and changed atomically.

An edit to the file applies while the server runs; a broken edit is rejected with its
reason (log, event stream, `infergate tenant list` shows the last error) and the last good
profile keeps serving. Changes through the admin API are written with tomlkit, which keeps
the file's comments and layout, to a temporary file that is checked, fsync'd and renamed
into place: a crash at any moment leaves either the old file or the new one, whole.

A live edit can close doors, never open them: an empty or missing file is rejected, a file
is applied only once it has stopped changing (half a write is not a profile), and the
settings that guard access (`admin_keys`, `allow_anonymous`) change live only when they
tighten access; otherwise they wait for the next start, as the bind address does. File
reads, writes and fsyncs run in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

import tomlkit
from tomlkit import TOMLDocument

from infergate.engine.cluster.settings import ClusterSettings
from infergate.engine.engine import Engine
from infergate.errors import BadRequest, ConfigError, NoProfileFile
from infergate.file_swap import swapped_in
from infergate.profile import DeviceSettings, Profile, ServerSettings, load_profile
from infergate.settings.table import MAX_PROFILE_BYTES, parse_toml, read_toml

# (mtime, size, inode) of the file; None when it is missing
Stamp = tuple[int, int, int] | None


def _is_empty(data: bytes) -> bool:
    """Nothing but blank lines and comments: an emptied file, not a profile."""
    lines = data.decode(errors="replace").splitlines()
    return all(not line.strip() or line.lstrip().startswith("#") for line in lines)


def read_profile(path: Path) -> Profile:
    """A profile for a live reload; an empty or missing file is refused (ConfigError), as
    is one that is no regular file, too large, or not UTF-8 (read once, by `read_toml`)."""
    if not path.exists():
        raise ConfigError(f"profile {path} is missing")
    data = read_toml(path, MAX_PROFILE_BYTES)
    if _is_empty(data):
        raise ConfigError(f"profile {path} is empty")
    return load_profile(path, data)


def _tightens(old: tuple[str, ...], new: tuple[str, ...]) -> bool:
    """Do admin keys `new` let in no one that `old` did not? No keys at all lets everyone
    in (on a loopback bind), so going from none to some tightens."""
    return set(new) == set(old) or (bool(new) and (not old or set(new) <= set(old)))


def guard_access(current: Profile, new: Profile) -> tuple[Profile, list[str]]:
    """`new`, with the access settings that would loosen access kept as they are; and
    the names of those held back until the next start."""
    now, asked = current.server, new.server
    held = []
    keys = asked.admin_keys
    if not _tightens(now.admin_keys, asked.admin_keys):
        keys = now.admin_keys
        held.append("admin_keys")
    anonymous = asked.allow_anonymous
    if asked.allow_anonymous and not now.allow_anonymous:
        anonymous = False
        held.append("allow_anonymous")
    server = replace(asked, admin_keys=keys, allow_anonymous=anonymous)
    return replace(new, server=server), held


# [server] settings the engine takes live (Profile.live_settings), as guard_access allows
LIVE_SERVER_FIELDS = frozenset({"admin_keys", "allow_anonymous"})


StartTable = ServerSettings | DeviceSettings | ClusterSettings


def changed(old: StartTable, new: StartTable) -> list[str]:
    """The fields of a start-time settings table that differ, by name (sorted), less
    those that apply live."""
    return sorted(
        f.name
        for f in fields(old)
        if f.name not in LIVE_SERVER_FIELDS and getattr(old, f.name) != getattr(new, f.name)
    )


class ProfileStore:
    def __init__(self, path: Path | None, profile: Profile, engine: Engine) -> None:
        self.path = path
        self.profile = profile
        self.last_error: str | None = None
        self._engine = engine
        self._stamp = self._stat()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def _stat(self) -> Stamp:
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def start(self, poll_s: float = 0.5) -> None:
        if self.path is not None:
            self._clean_temporaries()
            self._task = asyncio.create_task(self._watch(poll_s), name="profile-watcher")

    def _clean_temporaries(self) -> None:
        """Temporary files an edit left when the process was killed mid-write."""
        assert self.path is not None
        with contextlib.suppress(OSError):
            for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
                tmp.unlink(missing_ok=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self, poll_s: float) -> None:
        seen = self._stamp  # what the last look saw; applied once two looks agree
        while True:
            await asyncio.sleep(poll_s)
            stamp = await asyncio.to_thread(self._stat)
            changed, settled = stamp != self._stamp, stamp == seen
            seen = stamp
            if not changed or not settled:
                continue  # unchanged, or still being written: look again
            self._stamp = stamp
            async with self._lock:
                assert self.path is not None
                try:
                    profile = await asyncio.to_thread(read_profile, self.path)
                except ConfigError as exc:
                    self._rejected(exc)
                else:
                    self._accept(profile)

    def reload(self) -> bool:
        """Read the file again; apply it, or keep the last good profile and say why."""
        assert self.path is not None
        try:
            profile = read_profile(self.path)
        except ConfigError as exc:
            self._rejected(exc)
            return False
        self._accept(profile)
        return True

    def _rejected(self, exc: ConfigError) -> None:
        self.last_error = str(exc)
        self._engine.context.events.publish(
            "profile_rejected", "", f"{exc}; the last good profile keeps serving"
        )

    def _accept(self, profile: Profile) -> None:
        self._apply(profile)
        self._engine.context.events.publish("profile_applied", "", f"{self.path} applied")

    def _apply(self, profile: Profile) -> None:
        profile, held = guard_access(self.profile, profile)
        events = self._engine.context.events
        if held:
            events.publish(
                "profile_restart_needed",
                "",
                f"server.{' and server.'.join(held)} changed in a way that opens access; "
                "that applies at the next start (infergate serve), not live",
            )
        for table in ("server", "devices", "cluster"):
            names = changed(getattr(self.profile, table), getattr(profile, table))
            if names:
                they = "they apply" if len(names) > 1 else "it applies"
                events.publish(
                    "profile_restart_needed",
                    "",
                    f"[{table}] {', '.join(names)} changed; {they} at the next start "
                    "(infergate serve)",
                )
        self._engine.apply_settings(profile.live_settings())
        self.profile = profile
        self.last_error = None

    async def edit(self, change: Callable[[TOMLDocument], None]) -> Profile:
        """Change the profile file with `change`, check the result, write it atomically,
        apply it. A change that makes the profile invalid is refused (400), file untouched."""
        if self.path is None:
            raise NoProfileFile(
                "the server runs without a profile file, so changes cannot persist. Hint: "
                "start it with --profile FILE (or create profiles/default.toml)"
            )
        async with self._lock:
            profile = await asyncio.to_thread(self._write, change)
            self._stamp = self._stat()
            self._apply(profile)
            self._engine.context.events.publish(
                "profile_applied", "", f"{self.path} changed through the admin API"
            )
            return profile

    def _write(self, change: Callable[[TOMLDocument], None]) -> Profile:
        """In a thread: read, change, check, write beside, fsync, rename, fsync the folder.
        The new file keeps the old one's permissions."""
        path = self.path
        assert path is not None
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            raise NoProfileFile(
                f"the profile file {path} is missing, so this change was not made (writing "
                "it now would drop every setting and key it held). Hint: restore the file "
                "(the server keeps serving the last good profile), then try again"
            ) from None
        data = read_toml(path, MAX_PROFILE_BYTES)  # (no FIFO, nothing huge: ConfigError)
        parse_toml(path, data)  # (nested too deeply, not UTF-8: ConfigError, as a reload's)
        document = tomlkit.parse(data.decode())
        change(document)
        # (The check reads the new file by `path`'s form, as the watcher does, so a
        # relative `models` resolves alike in both: no false change.)
        with swapped_in(path, mode) as (f, tmp):
            f.write(tomlkit.dumps(document).encode())
            f.flush()
            os.fsync(f.fileno())
            try:
                profile = load_profile(tmp)
            except ConfigError as exc:
                raise BadRequest(str(exc).replace(str(tmp), str(path))) from None
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself survives a power cut
        finally:
            os.close(folder)
        return replace(profile, source=path)
