"""The scheduler's queue under random arrivals, deadlines, sizes and service times, on an
injected clock: every request gets exactly one outcome, nothing starts after its
deadline, the most urgent job always goes first, and batches respect their limits."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from infergate.clock import FakeClock
from infergate.engine.scheduling.classes import DEFAULT_CLASSES, PriorityClass
from infergate.engine.scheduling.queue import Job, JobQueue, QueueFull, QueuePolicy


@dataclass
class Request:
    id: int
    at: float
    cls: PriorityClass
    rows: int
    key: int
    patience: float
    pin: int | None


requests = st.lists(
    st.builds(
        Request,
        id=st.just(0),
        at=st.floats(0, 0.2),
        cls=st.sampled_from(DEFAULT_CLASSES),
        rows=st.integers(1, 6),
        key=st.integers(0, 1),
        patience=st.floats(0.0, 0.05),
        pin=st.sampled_from([None, None, 0, 1]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    reqs=requests,
    instances=st.integers(1, 3),
    service=st.floats(0.0005, 0.02),
    max_batch=st.sampled_from([1, 4, 8]),
    max_queue=st.integers(1, 20),
    delay=st.sampled_from([0.0, 0.002, 0.01]),
    patient=st.booleans(),
)
def test_queue_promises(
    reqs: list[Request],
    instances: int,
    service: float,
    max_batch: int,
    max_queue: int,
    delay: float,
    patient: bool,
) -> None:
    for i, r in enumerate(reqs):
        r.id = i
    clock = FakeClock(0.0)
    queue: JobQueue[int] = JobQueue(QueuePolicy(max_batch, delay, max_queue))
    outcome: dict[int, str] = {}
    started: dict[int, float] = {}
    busy_until = [0.0] * instances
    arrivals = sorted(reqs, key=lambda r: (r.at, r.id))
    jobs: dict[int, Job[int]] = {}

    def record(job: Job[int], what: str) -> None:
        assert job.payload not in outcome, f"request {job.payload} answered twice"
        outcome[job.payload] = what

    steps = 0
    while True:
        steps += 1
        assert steps < 10_000
        now = clock.now()
        for job in queue.expire(now):
            assert job.deadline < now
            record(job, "expired")
        while arrivals and arrivals[0].at <= now:
            r = arrivals.pop(0)
            pin = None if r.pin is None else r.pin % instances
            job = Job(r.id, r.cls, now, now + r.patience, r.rows, r.key, pin)  # arrives now
            jobs[r.id] = job
            try:
                for victim in queue.admit([job]):
                    assert victim.cls.rank > job.cls.rank  # only lower classes are shed
                    record(victim, "shed")
            except QueueFull:
                record(job, "rejected")
        wake = None
        for i in range(instances):
            if busy_until[i] > now:
                continue
            before = [j for j in queue.waiting() if j.pin in (None, i)]
            taken = queue.take(now, may_wait=patient, instance=i)
            if taken is None:
                continue
            if isinstance(taken, float):
                assert patient
                assert now < taken <= before[0].arrival + delay + 1e-12
                wake = taken if wake is None else min(wake, taken)
                continue
            head = taken[0]
            assert head is before[0]  # the most urgent waiting job goes first
            assert all(j.order() >= head.order() for j in before)
            assert sum(j.rows for j in taken) <= max(max_batch, head.rows)
            assert len({j.key for j in taken}) == 1
            for job in taken:
                assert job.pin in (None, i), "ran on an instance it was not pinned to"
                assert job.deadline >= now, "started after its deadline"
                started[job.payload] = now
                record(job, "ran")
            busy_until[i] = now + service
        candidates = [t for t in busy_until if t > now]
        if arrivals:
            candidates.append(arrivals[0].at)
        if wake is not None:
            candidates.append(wake)
        deadline = queue.next_deadline()
        if deadline is not None:
            candidates.append(deadline + 1e-9)
        if not candidates:
            break
        clock.advance(max(min(candidates) - now, 1e-9))
    assert len(queue) == 0
    assert sorted(outcome) == [r.id for r in reqs]  # exactly one outcome each


def test_lower_classes_are_shed_first_and_full_queue_refuses() -> None:
    realtime, burst, batch = DEFAULT_CLASSES
    queue: JobQueue[str] = JobQueue(QueuePolicy(max_queue_size=2))
    queue.admit([Job("b1", batch, 0, 10)])
    queue.admit([Job("u1", burst, 0, 10)])
    [shed] = queue.admit([Job("r1", realtime, 0, 10)])
    assert shed.payload == "b1"
    try:
        queue.admit([Job("b2", batch, 0, 10)])
    except QueueFull:
        pass
    else:
        raise AssertionError("a batch job must not displace higher classes")
    assert [j.payload for j in queue.waiting()] == ["r1", "u1"]


def test_batch_waits_for_more_only_up_to_the_delay() -> None:
    burst = DEFAULT_CLASSES[1]
    queue: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=4, max_delay_s=0.002))
    queue.admit([Job("a", burst, 1.0, 1.2, rows=1, key="k")])
    assert queue.take(1.0) == 1.002  # wait for the batch to fill
    queue.admit([Job("b", burst, 1.001, 1.2, rows=2, key="k")])
    queue.admit([Job("c", burst, 1.001, 1.2, rows=1, key="other")])
    assert queue.take(1.001) == 1.002
    queue.admit([Job("d", burst, 1.0015, 1.2, rows=1, key="k")])
    batch = queue.take(1.0015)  # four rows: full, so no more waiting
    assert isinstance(batch, list)
    assert [j.payload for j in batch] == ["a", "b", "d"]
    assert queue.take(1.0015) == 1.003
    batch = queue.take(1.004)
    assert isinstance(batch, list)
    assert [j.payload for j in batch] == ["c"]
