"""The scheduler's refusals, worded once: a request too large for the queue, a full queue,
one shed for a more urgent one (or for a tenant that holds less of the queue), one past
its queue deadline, one whose second try could not start, and a stopped version."""

from __future__ import annotations

from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import QueuePolicy
from infergate.errors import InfergateError, Overloaded, QueueDeadlineExceeded, TooLargeForQueue


def too_large(model: str, rows: int, chunks: int, policy: QueuePolicy) -> TooLargeForQueue:
    return TooLargeForQueue(
        f"request of {rows} rows to model {model!r} is cut into {chunks} "
        f"batches of at most {policy.max_batch_size} rows, more than its queue "
        f"can ever hold (max_queue_size = {policy.max_queue_size}). Hint: send "
        f"at most {policy.max_batch_size * policy.max_queue_size} rows per "
        "request, or raise max_queue_size or max_batch_size under [batching]"
    )


def queue_full(model: str, queued: int, policy: QueuePolicy) -> Overloaded:
    return Overloaded(
        f"model {model!r} has {queued} requests queued, its limit "
        f"(max_queue_size = {policy.max_queue_size}); nothing of a lower class "
        "than yours could be shed, nor of a tenant holding more of it than yours. Hint: "
        "retry after a pause, or add instances"
    )


def shed(model: str, victim: PriorityClass, winner: PriorityClass) -> Overloaded:
    return Overloaded(
        f"model {model!r} is overloaded: this {victim.name} request was shed "
        f"to make room for a {winner.name} one. Hint: retry after a pause"
    )


def over_share(model: str, cls: PriorityClass) -> Overloaded:
    return Overloaded(
        f"model {model!r} is overloaded: this {cls.name} request was shed to make room "
        "for another tenant's, since its tenant holds more of its queue. Hint: retry "
        "after a pause, or send fewer requests at once"
    )


def expired(
    model: str, cls: PriorityClass, waited_s: float, patience_s: float
) -> QueueDeadlineExceeded:
    return QueueDeadlineExceeded(
        f"request to model {model!r} waited {waited_s * 1000:.0f} ms in the queue, past its "
        f"deadline of {patience_s * 1000:.0f} ms ({cls.name} class); "
        "it was not run. Hint: retry later, lower the load, or add instances"
    )


def not_run_again(first: InfergateError, waited_s: float, patience_s: float) -> InfergateError:
    """A request whose batch failed (its worker died, or was killed) and whose one more
    try found no instance within its deadline: the first failure (its status, its
    Retry-After), saying so."""
    said, hint, rest = str(first).partition(" Hint:")
    why = (
        f"{said.rstrip(' .')}; it was to run again alone, but no instance could take it "
        f"within its deadline of {patience_s * 1000:.0f} ms (it waited {waited_s * 1000:.0f} ms)."
    )
    error = type(first)(f"{why}{hint}{rest}")
    error.__cause__ = first
    return error


def stopped(model: str, version: int) -> Overloaded:
    return Overloaded(f"model {model!r} version {version} was stopped")
