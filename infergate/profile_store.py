"""The live profile: watched for edits, applied to the engine, and changed atomically.

An edit to the file applies while the server runs; a broken edit is rejected with its
reason (log, event stream, `infergate tenant list` shows the last error) and the last good
profile keeps serving. Changes through the admin API are written with tomlkit, which keeps
the file's comments and layout, to a temporary file that is checked, fsync'd and renamed
into place: a crash at any moment leaves either the old file or the new one, whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import tomlkit
from tomlkit import TOMLDocument

from infergate.engine.engine import Engine
from infergate.errors import BadRequest, ConfigError, InfergateError
from infergate.profile import Profile, load_profile


class NoProfileFile(InfergateError):
    status = 409


class ProfileStore:
    def __init__(self, path: Path | None, profile: Profile, engine: Engine) -> None:
        self.path = path
        self.profile = profile
        self.last_error: str | None = None
        self._engine = engine
        self._stamp = self._stat()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def _stat(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def start(self, poll_s: float = 0.5) -> None:
        if self.path is not None:
            self._task = asyncio.create_task(self._watch(poll_s), name="profile-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self, poll_s: float) -> None:
        while True:
            await asyncio.sleep(poll_s)
            stamp = self._stat()
            if stamp != self._stamp and stamp is not None:
                self._stamp = stamp
                async with self._lock:
                    self.reload()

    def reload(self) -> bool:
        """Read the file again; apply it, or keep the last good profile and say why."""
        assert self.path is not None
        events = self._engine.context.events
        try:
            profile = load_profile(self.path)
        except ConfigError as exc:
            self.last_error = str(exc)
            events.publish("profile_rejected", "", f"{exc}; the last good profile keeps serving")
            return False
        self._apply(profile)
        events.publish("profile_applied", "", f"{self.path} applied")
        return True

    def _apply(self, profile: Profile) -> None:
        for table in ("server", "devices"):
            if getattr(profile, table) != getattr(self.profile, table):
                self._engine.context.events.publish(
                    "profile_restart_needed",
                    "",
                    f"[{table}] settings changed; they apply at the next start (infergate serve)",
                )
        self._engine.apply_profile(profile)
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
            document = (
                tomlkit.parse(self.path.read_text()) if self.path.exists() else (tomlkit.document())
            )
            change(document)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                with tmp.open("w") as f:
                    f.write(tomlkit.dumps(document))
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    profile = load_profile(tmp)
                except ConfigError as exc:
                    raise BadRequest(str(exc).replace(str(tmp), str(self.path))) from None
                os.replace(tmp, self.path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            self._stamp = self._stat()
            self._apply(profile)
            self._engine.context.events.publish(
                "profile_applied", "", f"{self.path} changed through the admin API"
            )
            return profile
