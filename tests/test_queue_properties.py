"""The scheduler's queue under random arrivals, deadlines, sizes, tenants and service times,
on an injected clock: every job gets exactly one outcome, nothing starts after its deadline
unless its request had started, the job first in order always goes first, batches respect
their limits, jobs without a batch key run alone, and tenants of a class share fairly."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from infergate.clock import FakeClock
from infergate.engine.scheduling.classes import DEFAULT_CLASSES, PriorityClass
from infergate.engine.scheduling.queue import (
    Fairness,
    Group,
    Job,
    JobQueue,
    QueueFull,
    QueuePolicy,
)


@dataclass
class Request:
    id: int
    at: float
    cls: PriorityClass
    rows: int
    key: int | None
    patience: float
    pin: int | None
    parts: int
    tenant: int


requests = st.lists(
    st.builds(
        Request,
        id=st.just(0),
        at=st.floats(0, 0.2),
        cls=st.sampled_from(DEFAULT_CLASSES),
        rows=st.integers(1, 6),
        key=st.sampled_from([0, 1, None]),  # None: no batch dimension, never merged
        patience=st.floats(0.0, 0.05),
        pin=st.sampled_from([None, None, 0, 1]),
        parts=st.sampled_from([1, 1, 2, 3]),  # a large request cut into chunks
        tenant=st.integers(0, 2),
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
    queue: JobQueue[tuple[int, int]] = JobQueue(QueuePolicy(max_batch, delay, max_queue))
    outcome: dict[tuple[int, int], str] = {}
    started: dict[tuple[int, int], float] = {}
    started_groups: set[int] = set()
    busy_until = [0.0] * instances
    arrivals = sorted(reqs, key=lambda r: (r.at, r.id))
    jobs: dict[tuple[int, int], Job[tuple[int, int]]] = {}

    def record(job: Job[tuple[int, int]], what: str) -> None:
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
            group = Group() if r.parts > 1 else None
            fair = Fairness(r.tenant, 1.0 + r.tenant)
            parts = [
                Job((r.id, p), r.cls, now, now + r.patience, r.rows, r.key, pin, fair, group)
                for p in range(r.parts)
            ]  # arriving now
            for job in parts:
                jobs[job.payload] = job
            try:
                held = {
                    t: sum(1 for j in queue.waiting() if j.cls == r.cls and j.fair.tenant == t)
                    for t in range(3)
                }
                for victim in queue.admit(parts):
                    # Lower classes are shed, or in its class a tenant that held more of the
                    # queue (weighted) than this request's will.
                    tenant = int(victim.fair.tenant)  # type: ignore[call-overload]
                    assert victim.cls.rank > r.cls.rank or (
                        victim.cls.rank == r.cls.rank
                        and held[tenant] / victim.fair.weight
                        > (held[r.tenant] + len(parts)) / fair.weight
                    )
                    # A started request keeps its chunks against a higher class; in its own
                    # class a tenant holding more loses it whole.
                    assert victim.expirable or victim.cls.rank == r.cls.rank
                    if victim.group is not None:
                        assert not [j for j in queue.waiting() if j.group is victim.group]
                    record(victim, "shed")
            except QueueFull:
                for job in parts:
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
            if head.key is None:
                assert len(taken) == 1, "jobs without a batch key were merged"
            for job in taken:
                assert job.pin in (None, i), "ran on an instance it was not pinned to"
                went_on = job.group is not None and id(job.group) in started_groups
                assert job.deadline >= now or went_on, "started after its deadline"
                started[job.payload] = now
                record(job, "ran")
            started_groups.update(id(j.group) for j in taken if j.group is not None)
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
    assert sorted(outcome) == sorted(jobs)  # exactly one outcome each
    assert len(jobs) == sum(r.parts for r in reqs)


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


@settings(max_examples=200, deadline=None)
@given(
    backlog=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=60),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=4, max_size=4),
)
def test_tenants_of_a_class_share_fairly(
    backlog: list[tuple[int, int]], weights: list[float]
) -> None:
    """Start-time fair queuing's bound: while two tenants both have work waiting, the rows
    each got, over its weight, differ by at most one largest job of each (over weight),
    however the backlog arrived."""
    burst = DEFAULT_CLASSES[1]
    queue: JobQueue[int] = JobQueue(QueuePolicy(max_batch_size=1, max_queue_size=1000))
    for i, (tenant, rows) in enumerate(backlog):
        fair = Fairness(tenant, weights[tenant])
        queue.admit([Job(i, burst, 0.0, 10.0, rows, None, None, fair)])
    served = [0.0] * 4
    largest = [max((r for t, r in backlog if t == k), default=0) for k in range(4)]
    while True:
        waiting = {int(j.fair.tenant) for j in queue.waiting()}  # type: ignore[call-overload]
        for a in waiting:
            for b in waiting:
                gap = served[a] / weights[a] - served[b] / weights[b]
                bound = largest[a] / weights[a] + largest[b] / weights[b]
                assert gap <= bound + 1e-9, (a, b, served)
        taken = queue.take(0.0, may_wait=False)
        if taken is None:
            break
        assert isinstance(taken, list)
        [job] = taken
        served[int(job.fair.tenant)] += job.rows  # type: ignore[call-overload]


def test_a_light_tenant_goes_before_a_flooders_backlog() -> None:
    burst = DEFAULT_CLASSES[1]
    queue: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=1, max_queue_size=1000))
    for i in range(50):
        queue.admit([Job(f"flood{i}", burst, 0.0, 10.0, fair=Fairness("flooder"))])
    first = queue.take(0.0)
    assert isinstance(first, list)
    queue.admit([Job("light", burst, 0.1, 10.1, fair=Fairness("light"))])
    order = []
    while isinstance(taken := queue.take(0.2), list):
        order.append(taken[0].payload)
    assert order.index("light") <= 1  # behind at most the flooder's next job, not all 49


def test_a_started_request_is_never_expired_and_none_keys_never_merge() -> None:
    burst = DEFAULT_CLASSES[1]
    queue: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=8, max_delay_s=0.0))
    group = Group()
    queue.admit([Job(f"chunk{i}", burst, 0.0, 0.2, 8, "k", group=group) for i in range(3)])
    queue.admit([Job("lone1", burst, 0.0, 0.2, 1, None), Job("lone2", burst, 0.0, 0.2, 1, None)])
    first = queue.take(0.0)
    assert isinstance(first, list)
    assert [j.payload for j in first] == ["chunk0"]
    expired = queue.expire(5.0)  # long past every deadline
    assert sorted(j.payload for j in expired) == ["lone1", "lone2"]
    assert [j.payload for j in queue.waiting()] == ["chunk1", "chunk2"]
    assert queue.next_deadline() is None  # nothing left that can expire: no wake-ups
    queue2: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=8, max_delay_s=0.0))
    queue2.admit([Job("a", burst, 0.0, 0.2, 1, None), Job("b", burst, 0.0, 0.2, 1, None)])
    one = queue2.take(0.0)
    assert isinstance(one, list)
    assert len(one) == 1


def test_a_started_request_holding_the_queue_is_shed_whole_for_another_tenant() -> None:
    """One tenant's large request, cut into chunks and started, held a full queue: another
    tenant of its class found it full and nothing could be shed (started chunks were
    never shed). Now that request goes whole (its sender gets one 503), and a chunk of it
    keeps no place; a tenant's own newcomer still cannot shed it."""
    burst = DEFAULT_CLASSES[1]
    queue: JobQueue[tuple[str, int]] = JobQueue(QueuePolicy(max_batch_size=4, max_queue_size=8))
    bob, alice = Fairness("bob", 1.0), Fairness("alice", 1.0)
    group = Group()
    chunks = [Job(("bob", i), burst, 0.0, 0.2, 4, 0, None, bob, group) for i in range(9)]
    queue.admit(chunks[:8])
    taken = queue.take(0.0, may_wait=False)
    assert isinstance(taken, list)
    assert [j.payload for j in taken] == [("bob", 0)]  # started: 7 of its chunks wait
    assert group.started
    queue.admit([chunks[8]], force=True)  # (its last chunk, as if cut into 9)
    with_bob = Job(("bob-again", 0), burst, 0.0, 0.2, 1, 0, None, bob, None)
    try:
        queue.admit([with_bob])
    except QueueFull:
        pass  # its own tenant cannot shed it
    else:
        raise AssertionError("bob's newcomer shed bob's own request")
    shed = queue.admit([Job(("alice", 0), burst, 0.0, 0.2, 1, 0, None, alice, None)])
    assert sorted(j.payload for j in shed) == [("bob", i) for i in range(1, 9)]
    assert [j.payload for j in queue.waiting()] == [("alice", 0)]


def test_while_tenants_are_kept_apart_a_batch_holds_one_tenant_s_requests() -> None:
    """The breaker saw only the batches two tenants shared go slow: for a while, each
    batch holds one tenant's requests, so that the one whose rows slow them shows it."""
    burst = DEFAULT_CLASSES[1]
    queue: JobQueue[str] = JobQueue(QueuePolicy(max_batch_size=8, max_delay_s=0.0))

    def batches(now: float) -> list[list[str]]:
        for i, tenant in enumerate(("vic", "mal", "vic", "mal")):
            queue.admit([Job(f"{tenant}{i}", burst, now, now + 1, 1, "k", fair=Fairness(tenant))])
        taken = []
        while isinstance(batch := queue.take(now, may_wait=False), list):
            taken.append([j.payload for j in batch])
        return taken

    queue.apart_until = 5.0
    assert batches(1.0) == [["vic0", "vic2"], ["mal1", "mal3"]]
    assert batches(5.0) == [["vic0", "mal1", "vic2", "mal3"]]  # together again
