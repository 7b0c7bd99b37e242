"""Places in a model's sequence table (engine/scheduling/sequences.py), in-process on an
injected clock: one tenant's sequences, idle or busy, cannot hold every place of
max_sequences from another. tests/test_tenant_isolation.py holds the idle case end to
end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from infergate.clock import FakeClock
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.repository.sequence_config import SequenceSettings
from infergate.engine.scheduling.sequences import SequenceParams, SequenceTable
from infergate.errors import Overloaded, SequenceLost


@dataclass
class _Worker:
    alive: bool = True


@dataclass
class _Instance:
    """What the table reads of an instance."""

    index: int = 0
    ready: bool = True
    handle: Any = field(default_factory=_Worker)


INSTANCES = cast(list[Instance], [_Instance()])


async def test_a_tenant_keeping_its_sequences_busy_still_gives_a_place_up() -> None:
    """Tenant A holds both places and keeps a request running or queued on each (never
    idle): B's start was refused 31 times of 31. Now A's least recently used sequence is
    dropped for it: the step it was running keeps its answer, the next steps get 410, and
    at one place each neither can take the other's."""
    table = SequenceTable("m", SequenceSettings(max_sequences=2), FakeClock())
    first = table.open(SequenceParams(1, start=True), INSTANCES, "a")
    table.open(SequenceParams(2, start=True), INSTANCES, "a")  # both busy from here on
    bs = table.open(SequenceParams(1, start=True), INSTANCES, "b")
    assert (len(table), bs.key) == (2, ("b", 1))
    table.check(first, ran=True)  # the step it was running: answered
    with pytest.raises(SequenceLost, match="to make room for another tenant's"):
        table.check(first)  # the next one, queued behind it
    table.release(first)
    with pytest.raises(SequenceLost, match="to make room"):
        table.open(SequenceParams(1), INSTANCES, "a")
    with pytest.raises(Overloaded, match="max_sequences"):
        table.open(SequenceParams(3, start=True), INSTANCES, "a")  # one each: no taking back


async def test_an_idle_sequence_goes_before_a_busy_one() -> None:
    table = SequenceTable("m", SequenceSettings(max_sequences=3), FakeClock())
    busy = table.open(SequenceParams(1, start=True), INSTANCES, "a")
    idle = table.open(SequenceParams(2, start=True), INSTANCES, "a")
    table.release(idle)  # the more recently used, but idle
    table.open(SequenceParams(3, start=True), INSTANCES, "a")
    table.open(SequenceParams(1, start=True), INSTANCES, "b")
    table.check(busy)  # kept
    with pytest.raises(SequenceLost):
        table.open(SequenceParams(2), INSTANCES, "a")
