"""The gateway's side of sequences (Triton's sequence batcher): which sequences are live,
the instance each is bound to, and the implicit state carried between its requests.

A sequence starts with `sequence_start` and is bound to the ready instance that holds the
fewest live sequences, until its `sequence_end` or until it stays idle past the model's
idle timeout (read on the injected clock; idle sequences are dropped, state and all, when
the model is next asked, or by a timer that looks again when the oldest would expire). An
instance that dies takes its sequences with it: their next request is a SequenceLost (410)
rather than a silent restart from zero state. When the model's max_sequences are all
live, a tenant's start takes the place of the least recently used idle sequence of the
tenant holding the most, if that one holds more than the starter then will (that sequence
is lost: 410). Ids that ended badly (idle, lost) are remembered a while, so a late
request is told why.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from infergate.clock import Clock
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.repository.sequence_config import SequenceSettings
from infergate.engine.workers.protocol import Worker
from infergate.errors import BadRequest, InfergateError, Overloaded, SequenceLost, shown
from infergate.tensors import Array

SequenceId = int | str
_REMEMBERED = 4096  # ids that ended badly, kept to explain a late request


@dataclass(frozen=True)
class SequenceParams:
    """A request's V2 parameters sequence_id, sequence_start and sequence_end."""

    id: SequenceId
    start: bool = False
    end: bool = False


# Ids are kept (the live table, and the ended ones remembered: see _remember) for as long
# as their sequences last and after: an id of megabytes would keep megabytes.
MAX_SEQUENCE_ID = 256


def sequence_params(parameters: dict[str, Any]) -> SequenceParams | None:
    """The sequence a request belongs to, as tritonclient sends it (an integer or a string
    id; 0 or "" with no flags is no sequence, as in Triton)."""
    # Written out, not any(<genexpr>): this runs on every request.
    if (
        "sequence_id" not in parameters
        and "sequence_start" not in parameters
        and "sequence_end" not in parameters
    ):
        return None
    flags = []
    for key in ("sequence_start", "sequence_end"):
        value = parameters.get(key, False)
        if type(value) is not bool:
            raise BadRequest(f"parameters.{key} must be true or false, got {shown(value)}")
        flags.append(value)
    sid = parameters.get("sequence_id", 0)
    if (
        isinstance(sid, bool)
        or not isinstance(sid, (int, str))
        or (isinstance(sid, int) and sid < 0)
    ):
        raise BadRequest(
            f"parameters.sequence_id must be a non-negative integer or a string, got {shown(sid)}"
        )
    if isinstance(sid, str) and len(sid) > MAX_SEQUENCE_ID:
        raise BadRequest(
            f"parameters.sequence_id is a string of {len(sid)} characters; a sequence id "
            f"has at most {MAX_SEQUENCE_ID} (a UUID has 36)"
        )
    if sid in (0, ""):
        if any(flags):
            raise BadRequest(
                "parameters.sequence_start/sequence_end need a sequence_id (a non-zero "
                "integer or a non-empty string). Hint: infer(..., sequence_id=1, "
                "sequence_start=True)"
            )
        return None
    return SequenceParams(sid, flags[0], flags[1])


# A sequence is its tenant's: the same id from two tenants names two sequences, so no
# tenant can continue, end or restart another's (nor learn that it exists).
Key = tuple[str, SequenceId]


@dataclass(eq=False)
class Sequence:
    id: SequenceId
    key: Key  # (tenant, id): its place in the table
    instance: Instance
    worker: Worker | None  # the process it started on: another one has not its past
    last_used: float
    state: dict[str, Array] = field(default_factory=dict)  # empty: zeros (at start)
    busy: int = 0  # requests running or waiting for it: it is not idle meanwhile
    dropped: InfergateError | None = None  # dropped while busy: what its next steps get
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # its requests, in order


class SequenceTable:
    def __init__(self, model: str, settings: SequenceSettings, clock: Clock) -> None:
        self.model = model
        self.settings = settings
        self._clock = clock
        self._live: OrderedDict[Key, Sequence] = OrderedDict()  # least recent first
        self._ended: OrderedDict[Key, InfergateError] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, sid: SequenceId) -> bool:
        """Whether some tenant has a live sequence of this id."""
        return any(key[1] == sid for key in self._live)

    def stop(self) -> None:
        """The version stops: its sequences go with it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._live.clear()

    def _arm(self) -> None:
        """Look again when the least recently used sequence would be idle too long (in
        real time, as the loop counts it; the sweep itself reads the injected clock)."""
        if self._timer is not None:
            return
        # A busy sequence is not idle, however old its last use: its release arms again.
        oldest = next((s for s in self._live.values() if not s.busy), None)
        if oldest is None:
            return
        due = oldest.last_used + self.settings.idle_timeout_s - self._clock.now()
        delay = min(max(due, 0.0), self.settings.idle_timeout_s) + 0.001
        self._timer = asyncio.get_running_loop().call_later(delay, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self.sweep(self._clock.now())
        self._arm()

    def sweep(self, now: float) -> None:
        """Drop sequences idle past the timeout (their state with them)."""
        limit = self.settings.idle_timeout_s
        for key, seq in list(self._live.items()):
            if now - seq.last_used <= limit:
                break  # ordered by last use: the rest are more recent
            if seq.busy:
                continue
            del self._live[key]
            idle = now - seq.last_used
            self._remember(
                key,
                BadRequest(
                    f"sequence {shown(seq.id)} of model {self.model!r} was idle {idle:.1f} s, "
                    f"past the model's sequence idle timeout of {limit:g} s ([sequence] "
                    "idle_timeout_ms in model.toml), and was dropped with its state. Hint: "
                    "start it again (sequence_start), or raise idle_timeout_ms"
                ),
            )

    def open(self, params: SequenceParams, instances: list[Instance], tenant: str = "") -> Sequence:
        """The sequence a request of `tenant` runs in: a new one at its start (bound to an
        instance), else its live one; BadRequest (unknown, idle) or SequenceLost when
        there is none. The caller holds it busy until `release`."""
        now = self._clock.now()
        self.sweep(now)
        sid = params.id
        key = (tenant, sid)
        if params.start:
            if (
                key not in self._live
                and len(self._live) >= self.settings.max_sequences
                and not self._make_room(tenant)
            ):
                raise Overloaded(
                    f"model {self.model!r} holds {len(self._live)} live sequences, its limit "
                    f"(max_sequences = {self.settings.max_sequences} under [sequence] in "
                    "model.toml); a sequence frees its place at its end or when idle past "
                    f"{self.settings.idle_timeout_s:g} s. Hint: end sequences with "
                    "sequence_end, retry after a pause, or raise max_sequences"
                )
            self._ended.pop(key, None)
            instance = self._least_loaded(instances)
            seq = Sequence(sid, key, instance, instance.handle, now)
            self._live.pop(key, None)  # a start on a live id begins it again, as in Triton
            self._live[key] = seq
        else:
            found = self._live.get(key)
            if found is None:
                ended = self._ended.get(key)
                if ended is not None:
                    raise type(ended)(str(ended))
                raise BadRequest(
                    f"sequence {shown(sid)} of model {self.model!r} is not started (no live "
                    "sequence has this id). Hint: send its first request with "
                    "sequence_start=True"
                )
            seq = found
            self.check(seq)
            self._live.move_to_end(key)
        seq.busy += 1
        seq.last_used = now
        return seq

    def _make_room(self, tenant: str) -> bool:
        """Drop the least recently used sequence of the tenant that holds the most places,
        if it holds more than `tenant` will with one more: one tenant's sequences cannot
        take every place of max_sequences from the others (nor take it back). An idle one
        goes first, of any such tenant; else a busy one: a tenant that kept a request
        queued on each of its sequences held every place (31 of 31 starts of another's
        refused). The step it is running finishes; the next get the 410."""
        held: dict[str, int] = {}
        for owner, _ in self._live:
            held[owner] = held.get(owner, 0) + 1
        mine = held.get(tenant, 0) + 1
        over = [t for t in sorted(held, key=held.__getitem__, reverse=True) if held[t] > mine]
        for busy_too in (False, True):
            for most in over:
                victim = next(
                    (q for k, q in self._live.items() if k[0] == most and (busy_too or not q.busy)),
                    None,
                )
                if victim is None:
                    continue  # every one of its sequences has a request running
                del self._live[victim.key]
                lost = SequenceLost(
                    f"sequence {shown(victim.id)} of model {self.model!r} was dropped with its "
                    f"state to make room for another tenant's: its tenant held {held[most]} of "
                    f"the {self.settings.max_sequences} live sequences the model takes "
                    "(max_sequences), more than its share. Hint: end sequences with "
                    "sequence_end, then start this one again (sequence_start=True)"
                )
                victim.dropped = lost
                self._remember(victim.key, lost)
                return True
        return False

    def check(self, seq: Sequence, ran: bool = False) -> None:
        """SequenceLost when it was dropped for another tenant's (unless this step `ran`
        already: its answer stands), or its worker died since it started (and forget it)."""
        if seq.dropped is not None and not ran:
            raise type(seq.dropped)(str(seq.dropped))
        worker = seq.instance.handle
        if worker is seq.worker and worker is not None and worker.alive:
            return
        self.lose(seq, "the worker process that held it died")

    def lose(self, seq: Sequence, why: str) -> None:
        error = SequenceLost(
            f"sequence {shown(seq.id)} of model {self.model!r} is lost: {why} (instance "
            f"{seq.instance.index}), and its state with it. Hint: start the sequence again "
            "(sequence_start=True)"
        )
        self.close(seq)
        self._remember(seq.key, error)
        raise error

    def release(self, seq: Sequence) -> None:
        """A request of `seq` is over: it is idle from now."""
        seq.busy -= 1
        seq.last_used = self._clock.now()
        if self._live.get(seq.key) is seq:
            self._live.move_to_end(seq.key)  # keeps the table ordered by last use
        self._arm()

    def close(self, seq: Sequence) -> None:
        """It ended: forget it (unless a new sequence took its id since)."""
        if self._live.get(seq.key) is seq:
            del self._live[seq.key]

    def _remember(self, key: Key, error: InfergateError) -> None:
        self._ended[key] = error
        self._ended.move_to_end(key)
        while len(self._ended) > _REMEMBERED:
            self._ended.popitem(last=False)

    def _least_loaded(self, instances: list[Instance]) -> Instance:
        held = {i.index: 0 for i in instances}
        for seq in self._live.values():
            if seq.instance.index in held:
                held[seq.instance.index] += 1
        ready = [i for i in instances if i.ready] or instances
        return min(ready, key=lambda i: (held[i.index], i.index))
