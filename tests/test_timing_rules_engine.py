"""Timing rules of the engine in-process, on the FakeClock, through the worker seam: the
breaker's windows and probes, the model's and the client's timeouts, and queries of death
(a tenant whose lone requests end workers). Real Engine, Instances and Scheduler on the
in-process fake workers; tests/test_timing_rules.py holds the scheduler's and the
instances' rules beneath it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from infergate.clock import FakeClock
from infergate.engine.admission.breaker import BreakerPolicy
from infergate.engine.admission.tenants import Tenant
from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.inference import InferenceRequest
from infergate.engine.settings import LiveSettings
from infergate.errors import (
    CircuitOpen,
    DeadlineExceeded,
    ModelExecutionError,
    WorkerFailed,
)
from tests.fake_workers import FakeCall, FakeWorkers
from tests.polling import eventually
from tests.scripted_runtime import make_scripted

# ---- the engine: breakers and the client's timeout, on the FakeClock ----

BREAKER = BreakerPolicy(
    window_seconds=2,
    failure_rate=0.5,
    latency_p99_ms=150,
    consecutive_windows=2,
    min_requests=4,
    backoff_initial_s=1,
    backoff_max_s=4,
    probes=2,
)


class Gateway:
    def __init__(self, engine: Engine, clock: FakeClock, workers: FakeWorkers) -> None:
        self.engine, self.clock, self.workers = engine, clock, workers

    async def call(
        self, latency_s: float = 0.01, fail: bool = False, timeout_s: float | None = None
    ) -> tuple[asyncio.Task[object], FakeCall | None]:
        """One request to `m`: it takes `latency_s` on the clock, and fails if asked. The
        call is None when the engine refused it before any worker saw it."""
        x = np.ones((1, 4), np.float32)
        request = InferenceRequest("m", {"x": x}, timeout_s=timeout_s)
        task: asyncio.Task[object] = asyncio.create_task(self.engine.infer(request))
        await asyncio.sleep(0)
        if task.done():
            return task, None
        call = await self.workers.next_call()
        self.clock.advance(latency_s)
        if fail:
            call.fail()
        else:
            call.reply()
        await asyncio.gather(task, return_exceptions=True)
        return task, call


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=())
    (tmp_path / "models" / "m" / "model.toml").write_text("timeout_ms = 5000\n")
    clock, workers = FakeClock(), FakeWorkers()
    context = EngineContext(
        clock=clock, worker_factory=workers, settings=LiveSettings(breaker=BREAKER)
    )
    engine = Engine(EngineSettings(tmp_path / "models", "explicit"), context)
    await engine.start()
    await eventually(lambda: engine.ready and engine.version("m").ready, what="m to load")
    yield Gateway(engine, clock, workers)
    await engine.stop()


async def test_slow_answers_trip_the_breaker_and_good_probes_close_it(gateway: Gateway) -> None:
    outcomes = []
    for _ in range(20):
        task, call = await gateway.call(latency_s=0.2)  # 200 ms each, over the 150 ms p99
        if call is None:
            break
        outcomes.append(task.result() is not None)
    assert len(outcomes) >= 4  # min_requests answered first
    assert all(outcomes)  # they all succeeded, just too slowly
    with pytest.raises(CircuitOpen) as refused:
        await task
    assert "p99 latency 200 ms (limit 150 ms)" in str(refused.value)
    assert refused.value.retry_after_s == 1
    breaker = gateway.engine.version("m").breaker
    gateway.clock.advance(0.999)
    states = [breaker.state]
    gateway.clock.advance(0.001)  # the backoff is over: two fast probes close it
    for _ in range(2):
        task, call = await gateway.call(latency_s=0.01)
        assert call is not None
        await task
    states.append(breaker.state)
    assert states == ["open", "closed"]


async def test_failures_trip_the_breaker_and_a_failed_probe_doubles_its_backoff(
    gateway: Gateway,
) -> None:
    failures = 0
    while True:
        task, call = await gateway.call(latency_s=0.1, fail=True)
        if call is None:
            break
        failures += 1
        with pytest.raises(ModelExecutionError):
            await task
    assert 4 <= failures <= 10  # min_requests, then two bad evaluations 0.2 s apart
    with pytest.raises(CircuitOpen, match="failure rate 100%"):
        await task
    gateway.clock.advance(1)
    task, call = await gateway.call(fail=True)  # a probe, and it fails
    assert call is not None
    task, call = await gateway.call()
    assert call is None
    with pytest.raises(CircuitOpen) as refused:
        await task
    assert refused.value.retry_after_s == 2  # doubled from 1 s


async def test_a_probe_whose_caller_gave_up_does_not_keep_the_breaker_half_open(
    gateway: Gateway,
) -> None:
    """A probe cancelled while its batch runs (its client left: server/departure.py) has
    no outcome; its place is given back, or the breaker stayed half-open refusing everyone."""
    while True:  # trip it
        task, call = await gateway.call(fail=True)
        if call is None:
            break
    gateway.clock.advance(1)  # the backoff is over
    x = np.ones((1, 4), np.float32)
    probe = asyncio.create_task(gateway.engine.infer(InferenceRequest("m", {"x": x})))
    call = await gateway.workers.next_call()
    probe.cancel()  # its client left
    with pytest.raises(asyncio.CancelledError):
        await probe
    call.reply()
    breaker = gateway.engine.version("m").breaker
    for _ in range(2):  # `probes` good ones close it
        task, call = await gateway.call()
        assert call is not None
        await task
    assert breaker.state == "closed"


async def test_the_model_s_timeout_bounds_a_started_call(gateway: Gateway) -> None:
    _, call = await gateway.call()
    assert call is not None
    assert call.timeout_s == 5.0  # model.toml's timeout_ms: past it, the worker is killed


async def test_the_client_s_timeout_bounds_its_queue_wait(gateway: Gateway) -> None:
    x = np.ones((1, 4), np.float32)
    holder = asyncio.create_task(gateway.engine.infer(InferenceRequest("m", {"x": x})))
    running = await gateway.workers.next_call()
    request = InferenceRequest("m", {"x": x}, timeout_s=0.1)  # burst class: 200 ms
    waiting = asyncio.create_task(gateway.engine.infer(request))
    await asyncio.sleep(0)
    gateway.clock.advance(0.101)
    with pytest.raises(DeadlineExceeded, match="past its deadline of 100 ms"):
        await asyncio.wait_for(waiting, 10)  # the scheduler notices on its own
    running.reply()
    await holder
    assert len(gateway.workers.made[0].calls) == 1  # the late one never ran


async def test_the_client_s_timeout_never_kills_a_started_call(gateway: Gateway) -> None:
    _, call = await gateway.call(timeout_s=0.3)
    assert call is not None
    assert call.timeout_s == 5.0


# ---- queries of death: a tenant's lone requests that end workers, on the FakeClock ----


class Tenanted:
    """An engine serving `m` (two instances) to tenants alice and bob."""

    def __init__(self, engine: Engine, clock: FakeClock, workers: FakeWorkers) -> None:
        self.engine, self.clock, self.workers = engine, clock, workers

    async def send(self, tenant: str) -> tuple[asyncio.Task[object], FakeCall]:
        """One request of `tenant`, once it reached a worker."""
        state = self.engine.context.tenants.get(tenant)
        request = InferenceRequest("m", {"x": np.ones((1, 4), np.float32)})
        task: asyncio.Task[object] = asyncio.create_task(self.engine.infer(request, state))
        return task, await self.workers.next_call()

    async def served(self, tenant: str) -> None:
        task, call = await self.send(tenant)
        call.reply()
        await task


@contextlib.asynccontextmanager
async def serving_tenants(
    tmp_path: Path, instances: int, cls: str = "burst"
) -> AsyncIterator[Tenanted]:
    """An engine serving `m` on `instances` to tenants alice and bob, of class `cls`."""
    make_scripted(tmp_path / "models" / "m" / "1" / "model.scripted", controls=())
    toml = f"instances = {instances}\ntimeout_ms = 5000\n"
    (tmp_path / "models" / "m" / "model.toml").write_text(toml)
    clock, workers = FakeClock(), FakeWorkers()
    tenants = (Tenant("alice", cls), Tenant("bob", cls))
    settings = LiveSettings(breaker=BREAKER, tenants=tenants, allow_anonymous=False)
    context = EngineContext(clock=clock, worker_factory=workers, settings=settings)
    engine = Engine(EngineSettings(tmp_path / "models", "explicit"), context)
    await engine.start()
    try:
        await eventually(lambda: engine.ready and engine.version("m").ready, what="m to load")
        await eventually(lambda: len(workers.made) == instances, what="the workers")
        yield Tenanted(engine, clock, workers)
    finally:
        await engine.stop()


@pytest.fixture
async def tenanted(tmp_path: Path) -> AsyncIterator[Tenanted]:
    async with serving_tenants(tmp_path, 2) as served:
        yield served


async def test_a_tenant_whose_lone_requests_end_two_workers_is_cut_off_alone(
    tenanted: Tenanted,
) -> None:
    """B's request, alone on its worker, ends it: it is not run again on the sibling
    (which it would end too), and A is served there. B's next one ends a worker again,
    within the window: B is cut off (503, Retry-After, the reason), without min_requests,
    and A is not. Before, the sibling ran B's request again and died too, and B went on."""
    await tenanted.served("alice")
    task, call = await tenanted.send("bob")
    call.worker.end("was killed by signal 11")
    await eventually(lambda: task.done() or tenanted.workers.pending(), what="B's answer")
    assert not tenanted.workers.pending()  # not run again on the sibling
    with pytest.raises(WorkerFailed, match="signal 11"):
        await task
    _, alice = await tenanted.send("alice")
    assert alice.worker is not call.worker
    assert alice.worker.alive
    alice.reply()
    tenanted.clock.advance(0.5)  # within the window of 2 s
    task, call = await tenanted.send("bob")
    call.time_out()  # past the model's timeout: killed too
    with pytest.raises(DeadlineExceeded):
        await task
    tenanted.clock.advance(0.3)  # both workers restart (backoff 0.25 s)
    served = tenanted.engine.version("m")
    await eventually(lambda: all(i.ready for i in served.instances), what="the restarts")
    state = tenanted.engine.context.tenants.get("bob")
    request = InferenceRequest("m", {"x": np.ones((1, 4), np.float32)})
    with pytest.raises(CircuitOpen) as refused:
        await tenanted.engine.infer(request, state)
    message = str(refused.value)
    assert "cut off for tenant 'bob'" in message
    assert "its requests ended 2 workers of this version within 2 s" in message
    assert refused.value.retry_after_s == pytest.approx(0.7)  # 1 s from the second death
    breaker = served.breaker
    assert (breaker.state, set(breaker.cut_off_tenants())) == ("closed", {"bob"})
    await tenanted.served("alice")
    assert len(tenanted.workers.made) == 4  # two deaths, not three


async def test_a_lone_request_that_ended_its_worker_is_tried_again_once_in_a_window(
    gateway: Gateway,
) -> None:
    """No tenants: the default tenant's lone request that ended its worker gets one more
    try (chance may have done it), once a window; nobody is cut off (nobody to protect)."""
    x = np.ones((1, 4), np.float32)
    engine = gateway.engine
    task = asyncio.create_task(engine.infer(InferenceRequest("m", {"x": x})))
    first = await gateway.workers.next_call()
    first.worker.end("was killed by signal 9")
    gateway.clock.advance(1)  # the only instance restarts (backoff 0.25 s)
    retry = await gateway.workers.next_call(what="the retry after the restart")
    retry.reply()
    await task
    task = asyncio.create_task(engine.infer(InferenceRequest("m", {"x": x})))
    (await gateway.workers.next_call()).worker.end("was killed by signal 9")
    with pytest.raises(WorkerFailed):
        await asyncio.wait_for(task, 10)  # it ended one already in the window: no retry
    assert not gateway.workers.pending()
    breaker = engine.version("m").breaker
    assert (breaker.state, breaker.cut_off_tenants()) == ("closed", {})


@pytest.fixture
async def one_shared(tmp_path: Path) -> AsyncIterator[Tenanted]:
    """`tenanted` on one instance, in the batch class (its requests wait up to 30 s): what
    waits while it runs goes as one batch."""
    async with serving_tenants(tmp_path, 1, "batch") as served:
        yield served


async def test_bs_slow_rows_in_batches_with_as_cut_off_b_not_the_model(
    one_shared: Tenanted,
) -> None:
    """The attack: B's rows make every batch they are in take 300 ms (the limit: 150 ms),
    A's alone take 10 ms, and A's requests wait behind B's and run batched with them.
    Before, A's requests counted the 300 ms as A's own: A looked as slow as B, and the
    breaker opened for everyone. Now the batches without B (A's alone) show the model is
    fine without it: B alone is cut off, A's requests are all answered, and so is the
    one of A's in the batch that ran with B's while B was cut off."""
    gate, clock, engine = one_shared, one_shared.clock, one_shared.engine
    breaker = engine.version("m").breaker

    def infer(tenant: str) -> asyncio.Task[object]:
        state = engine.context.tenants.get(tenant)
        request = InferenceRequest("m", {"x": np.ones((1, 4), np.float32)})
        return asyncio.create_task(engine.infer(request, state))

    await gate.served("alice")
    rounds = 0
    while breaker.cut_off("bob") is None:
        rounds += 1
        assert rounds <= 10, breaker.reason
        alone = infer("bob")
        call = await gate.workers.next_call()  # B's, alone
        shared = [infer("alice"), infer("bob")]  # they wait behind it
        await asyncio.sleep(0)
        clock.advance(0.3)
        call.reply()
        batch = await gate.workers.next_call(what="A's and B's as one batch")
        assert batch.rows == 2
        clock.advance(0.3)
        batch.reply()
        await asyncio.gather(alone, *shared, return_exceptions=True)
        assert shared[0].result() is not None  # A's, answered
        assert breaker.state == "closed", breaker.reason  # before: "p99 latency 300 ms"
        task, call = await gate.send("alice")  # A's alone, fast
        clock.advance(0.01)
        call.reply()
        await task
    assert breaker.state == "closed", breaker.reason
    assert "p99 latency of its requests is above 150 ms" in (breaker.cut_off("bob") or "")
    with pytest.raises(CircuitOpen, match="cut off for tenant 'bob'"):
        await infer("bob")
    for _ in range(20):  # A's, for two windows: all answered, the breaker stays closed
        assert breaker.state == "closed", breaker.reason
        await gate.served("alice")
        clock.advance(0.1)
