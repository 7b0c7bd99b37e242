"""A batch's successes counted at once (`Breaker.record_served`, the runner's call for the
requests a batch answered) leave the breaker exactly as recording each request in turn
does: its counts by tenant, the latency samples and their random draws, the tenants
served well, cut-offs and verdicts, over any mix of tenants, shared batches, failures,
slow batches and time; and a request run again after its batch failed is counted once,
for its whole time."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infergate.clock import FakeClock
from infergate.engine.admission.breaker import Breaker
from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.inference import InferenceRequest
from tests.breaker_policy import POLICY
from tests.fake_workers import FakeWorkers
from tests.polling import eventually
from tests.scripted_runtime import make_scripted

TENANTS = st.sampled_from(["alice", "bob", "carol", None])
# A batch: its requests' tenants, its latency (the limit is 100 ms), and whether it failed.
BATCH = st.tuples(
    st.lists(TENANTS, min_size=1, max_size=70),
    st.sampled_from([0.01, 0.05, 0.2]),
    st.booleans(),
)
STEP = st.one_of(BATCH, st.sampled_from([0.0, 0.03, 0.1, 0.7, 3.0]))  # or time passing


def _snapshot(breaker: Breaker) -> dict[str, Any]:
    """Everything a breaker holds, comparable (buckets and cut-offs as plain data)."""
    held = {}
    for name in dir(breaker):
        if not name.startswith("_") or name.startswith("__") or name == "_clock":
            continue
        value = getattr(breaker, name)
        if callable(value) and not isinstance(value, (dict, list)):
            continue
        if name == "_buckets":
            value = [dataclasses.asdict(b) for b in value]
        elif name == "_cut":
            value = {t: dataclasses.astuple(c) for t, c in value.items()}
        elif name == "_random":
            value = value.getstate()
        held[name] = value
    held["state"], held["reason"] = breaker.state, breaker.reason
    return held


Batch = tuple[list[Hashable], float, bool]  # its requests' tenants, latency, whether it failed


def _admitted(breaker: Breaker, tenants: list[Hashable]) -> list[Hashable]:
    return [t for t in tenants if breaker.allow(t) == "normal"]


def _record(one_by_one: Breaker, at_once: Breaker, batch: Batch) -> None:
    admitted, latency_s, failed = batch
    shared = frozenset(admitted) if len(set(admitted)) > 1 else None
    for tenant in admitted:
        one_by_one.record("normal", not failed, latency_s, tenant, shared)
    if failed:  # failures are judged one by one either way
        for tenant in admitted:
            at_once.record("normal", False, latency_s, tenant, shared)
    elif admitted:
        at_once.record_served(admitted, latency_s, shared)


@settings(max_examples=200, deadline=None)
@given(st.lists(STEP, min_size=1, max_size=40))
def test_a_batch_counted_at_once_leaves_the_breaker_as_its_requests_one_by_one(
    steps: list[Any],
) -> None:
    """Each batch is admitted, then answered after the next one is admitted: its requests
    were in flight while the breaker moved on (a tenant cut off meanwhile, for one)."""
    one_by_one_clock, at_once_clock = FakeClock(), FakeClock()
    one_by_one, at_once = Breaker(POLICY, one_by_one_clock), Breaker(POLICY, at_once_clock)
    in_flight: Batch | None = None
    for step in steps:
        if isinstance(step, float):
            one_by_one_clock.advance(step)
            at_once_clock.advance(step)
            continue
        tenants, latency_s, failed = step
        admitted = _admitted(one_by_one, tenants)
        assert _admitted(at_once, tenants) == admitted
        if in_flight is not None:
            _record(one_by_one, at_once, in_flight)
        in_flight = (admitted, latency_s, failed)
        assert _snapshot(at_once) == _snapshot(one_by_one)
    if in_flight is not None:
        _record(one_by_one, at_once, in_flight)
    assert _snapshot(at_once) == _snapshot(one_by_one)


def test_past_a_buckets_sample_a_batch_keeps_the_same_latencies_as_one_by_one() -> None:
    """Thousands of requests in one bucket: past the first 1,024 latencies the sample is
    a reservoir, and a batch draws exactly what its requests' records would."""
    clocks = FakeClock(), FakeClock()
    one_by_one, at_once = Breaker(POLICY, clocks[0]), Breaker(POLICY, clocks[1])
    for i in range(200):
        latency_s = 0.0001 * i
        tenants: list[Hashable] = [*["alice"] * 20, *["bob"] * 12]
        for tenant in tenants:
            one_by_one.record("normal", True, latency_s, tenant, frozenset(tenants))
        at_once.record_served(tenants, latency_s, frozenset(tenants))
    bucket = at_once._buckets[-1]
    assert bucket.measured == 6400
    assert len(bucket.latencies) == 1024
    # The first 32 batches filled the sample; most of what it keeps came after them.
    assert sum(latency_s > 0.0032 for latency_s in bucket.latencies) > 700
    assert _snapshot(at_once) == _snapshot(one_by_one)


def test_successes_in_flight_when_their_tenant_was_cut_off_count_for_nobody() -> None:
    """Bob's requests fail while Alice's are served: the next evaluation cuts Bob off.
    His successes admitted before it, alone or batched with Alice's, count for nobody
    after it (they would make the window look better for him, or worse for her)."""
    clocks = FakeClock(), FakeClock()
    one_by_one, at_once = Breaker(POLICY, clocks[0]), Breaker(POLICY, clocks[1])
    _record(one_by_one, at_once, (["alice"] * 6, 0.01, False))
    _record(one_by_one, at_once, (["bob"] * 6, 0.01, True))
    in_flight: list[Batch] = [
        (["bob", "bob"], 0.01, False),
        (["alice", "bob", "alice"], 0.01, False),
    ]
    for batch in in_flight:
        assert _admitted(one_by_one, batch[0]) == _admitted(at_once, batch[0]) == batch[0]
    for clock in clocks:
        clock.advance(0.1)
    assert _admitted(one_by_one, ["alice"]) == _admitted(at_once, ["alice"]) == ["alice"]
    assert at_once.cut_off("bob") is not None
    assert one_by_one.cut_off("bob") is not None
    ok_before = sum(b.ok for b in at_once._buckets)
    for batch in in_flight:
        _record(one_by_one, at_once, batch)
    assert sum(b.ok for b in at_once._buckets) == ok_before
    assert _snapshot(at_once) == _snapshot(one_by_one)
    _record(one_by_one, at_once, (["alice", "alice"], 0.01, False))
    assert sum(b.ok for b in at_once._buckets) == ok_before + 2
    assert _snapshot(at_once) == _snapshot(one_by_one)


async def test_a_request_run_again_counts_from_its_first_start(tmp_path: Path) -> None:
    """A request whose worker crashed runs again on the sibling, in a job of its own that
    starts its clock anew: it is counted once, in Triton's statistics and the breaker,
    for its whole time (both runs), not only its second run's."""
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=())
    (tmp_path / "models" / "m" / "model.toml").write_text("timeout_ms = 5000\ninstances = 2\n")
    clock, workers = FakeClock(), FakeWorkers()
    context = EngineContext(clock=clock, worker_factory=workers)
    engine = Engine(EngineSettings(tmp_path / "models", "explicit"), context)
    await engine.start()
    try:
        await eventually(lambda: engine.ready and engine.version("m").ready, what="load")
        x = np.ones((1, 4), np.float32)
        request = asyncio.create_task(engine.infer(InferenceRequest("m", {"x": x})))
        first = await workers.next_call()
        clock.advance(1.0)
        first.worker.end("crashed")
        again = await workers.next_call("the request's second run")
        clock.advance(0.01)
        again.reply()
        await request
        served = engine.version("m")
        success = served.scheduler.stats.success
        assert success.count == 1
        assert success.ns == pytest.approx(1.01e9, rel=1e-6)
        assert sum(b.ok for b in served.breaker._buckets) == 1
    finally:
        await engine.stop()


async def test_requests_run_again_alone_count_from_their_first_start(tmp_path: Path) -> None:
    """A batch the model raised on runs again request by request, each in a new job: each
    request is counted for its whole time, the failed batch's second included."""
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=())
    (tmp_path / "models" / "m" / "model.toml").write_text("[batching]\nmax_queue_delay_ms = 0\n")
    clock, workers = FakeClock(), FakeWorkers()
    engine = Engine(
        EngineSettings(tmp_path / "models", "explicit"),
        EngineContext(clock=clock, worker_factory=workers),
    )
    await engine.start()
    try:
        await eventually(lambda: engine.ready and engine.version("m").ready, what="load")
        x = np.ones((1, 4), np.float32)
        requests = [asyncio.create_task(engine.infer(InferenceRequest("m", {"x": x})))]
        lone = await workers.next_call()
        requests += [
            asyncio.create_task(engine.infer(InferenceRequest("m", {"x": x}))) for _ in range(2)
        ]
        await asyncio.sleep(0)  # both queue behind the lone request's batch
        clock.advance(0.01)
        lone.reply()
        pair = await workers.next_call("the two queued, batched")
        assert pair.rows == 2
        clock.advance(1.0)
        pair.fail()
        for _ in range(2):
            alone = await workers.next_call("a request run again alone")
            clock.advance(0.01)
            alone.reply()
        await asyncio.gather(*requests)
        success = engine.version("m").scheduler.stats.success
        assert success.count == 3
        # Each of the two ran a second in the failed batch (counted from its new job,
        # each would show a hundredth of one).
        assert success.ns >= 2 * 1.0e9
    finally:
        await engine.stop()
