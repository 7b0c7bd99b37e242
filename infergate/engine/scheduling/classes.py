"""Priority classes: a rank (0 is the most urgent) and a queue deadline.

A request's class comes from its tenant, or from the V2 `parameters` (`priority` as
tritonclient sends it, an integer where 1 is the highest and 0 the default, or a class
name), never above the class its tenant may ask for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infergate.errors import BadRequest, ConfigError, shown


@dataclass(frozen=True)
class PriorityClass:
    name: str
    rank: int
    deadline_s: float


DEFAULT_CLASSES = (
    PriorityClass("realtime", 0, 0.050),
    PriorityClass("burst", 1, 0.200),
    PriorityClass("batch", 2, 30.0),
)


class ClassTable:
    def __init__(self, classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES) -> None:
        if not classes:
            raise ConfigError("at least one priority class is needed")
        self.ordered = tuple(sorted(classes, key=lambda c: c.rank))
        self._by_name = {c.name: c for c in classes}

    def get(self, name: str) -> PriorityClass:
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(
                f"unknown priority class {name!r}; the profile defines {', '.join(self._by_name)}"
            ) from None

    def resolve(self, requested: Any, cap: PriorityClass) -> PriorityClass:
        """The class a request runs in: what it asked for, but never above `cap`."""
        if isinstance(requested, bool):  # (before == 0: False == 0, and so does 0.0)
            raise BadRequest(
                f"parameters.priority must be a class name or integer, got {requested}"
            )
        if requested is None or (isinstance(requested, int) and requested == 0):
            return cap  # Triton's 0: the model's default level
        if isinstance(requested, int):
            if requested < 0:
                raise BadRequest(f"parameters.priority must be >= 0, got {requested}")
            # tritonclient: 1 is the highest level; levels past the last class are the last.
            wanted = self.ordered[min(requested, len(self.ordered)) - 1]
        elif isinstance(requested, str):
            if requested not in self._by_name:
                raise BadRequest(
                    f"parameters.priority {shown(requested)} is not a class; use one of "
                    f"{', '.join(c.name for c in self.ordered)} or an integer (1 is highest)"
                )
            wanted = self._by_name[requested]
        else:
            raise BadRequest(
                f"parameters.priority must be a class name or integer, got {shown(requested)}"
            )
        return wanted if wanted.rank >= cap.rank else cap
