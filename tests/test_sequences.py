"""Sequences in-process, on the FakeClock, through the worker seam: what the gateway feeds
the model (controls and implicit state), ordering and batching of sequences, the idle
timeout, and a sequence whose instance died. Real Engine, Instances and Scheduler; fake
workers that answer when the test says (tests/fake_workers.py). The same flows against
the real server, through tritonclient, are in test_sequences_triton.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infergate.clock import FakeClock
from infergate.engine.admission.tenants import DEFAULT_TENANT, Tenant
from infergate.engine.context import EngineContext
from infergate.engine.engine import Engine, EngineSettings
from infergate.engine.inference import InferenceRequest, InferenceResult
from infergate.engine.repository.modelconfig import parse_model_config
from infergate.engine.scheduling.sequence_step import infer_in_sequence
from infergate.engine.scheduling.sequences import (
    SequenceId,
    SequenceParams,
    SequenceTable,
    sequence_params,
)
from infergate.errors import BadRequest, ConfigError, ModelFailed, Overloaded, SequenceLost
from tests.fake_workers import FakeCall, FakeWorkers
from tests.polling import eventually
from tests.sequence_models import make_accumulator

INT32 = ("INPUT", "START", "END", "READY", "STATE_IN")
MODEL_TOML = (
    "instances = {instances}\n"
    + "".join(f'[[inputs]]\nname = "{n}"\ndatatype = "INT32"\nshape = [-1, 1]\n' for n in INT32)
    + '[[inputs]]\nname = "CORRID"\ndatatype = "INT64"\nshape = [-1, 1]\n'
    + "".join(
        f'[[outputs]]\nname = "{n}"\ndatatype = "INT32"\nshape = [-1, 1]\n'
        for n in ("OUTPUT", "STATE_OUT")
    )
    + "[sequence]\nidle_timeout_ms = {idle_timeout_ms}\nmax_sequences = 3\n"
    + 'start = "START"\nend = "END"\nready = "READY"\ncorrid = "CORRID"\n'
    + '[[sequence.state]]\ninput = "STATE_IN"\noutput = "STATE_OUT"\n'
)


class Rig:
    def __init__(self, engine: Engine, clock: FakeClock, workers: FakeWorkers) -> None:
        self.engine, self.clock, self.workers = engine, clock, workers

    @property
    def table(self) -> SequenceTable:
        table = self.engine.version("m").sequences
        assert table is not None
        return table

    async def ask(
        self, value: int, sid: SequenceId, start: bool = False, end: bool = False, cls: str = ""
    ) -> asyncio.Task[InferenceResult]:
        """Send one request of sequence `sid`; returns once it is queued or running."""
        x = np.full((1, 1), value, np.int32)
        sequence = SequenceParams(sid, start, end)
        request = InferenceRequest("m", {"INPUT": x}, priority=cls or None, sequence=sequence)
        task = asyncio.create_task(self.engine.infer(request))
        for _ in range(5):  # past admission, into the scheduler
            await asyncio.sleep(0)
        return task

    def pending(self) -> list[FakeCall]:
        return self.workers.pending()


def accumulate(call: FakeCall) -> None:
    """The model: OUTPUT = INPUT + STATE_IN, STATE_OUT = OUTPUT."""
    total = np.add(call.inputs["INPUT"], call.inputs["STATE_IN"])
    call.reply({"OUTPUT": total, "STATE_OUT": total.copy()})


async def answer(rig: Rig, task: asyncio.Task[InferenceResult]) -> int:
    call = await rig.workers.next_call()
    accumulate(call)
    return int((await task).outputs["OUTPUT"][0, 0])


@asynccontextmanager
async def started(
    tmp_path: Path, instances: int = 1, idle_timeout_ms: int = 5000, toml: str = ""
) -> AsyncIterator[Rig]:
    make_accumulator(tmp_path / "models" / "m" / "1" / "model.onnx")
    toml = toml or MODEL_TOML.format(instances=instances, idle_timeout_ms=idle_timeout_ms)
    (tmp_path / "models" / "m" / "model.toml").write_text(toml)
    clock, workers = FakeClock(), FakeWorkers()
    engine = Engine(
        EngineSettings(tmp_path / "models", "explicit"),
        EngineContext(clock=clock, worker_factory=workers),
    )
    await engine.start()
    await eventually(
        lambda: engine.ready and all(i.ready for i in engine.version("m").instances),
        what="m to load",
    )
    try:
        yield Rig(engine, clock, workers)
    finally:
        await engine.stop()


async def test_the_gateway_feeds_controls_and_carries_state(tmp_path: Path) -> None:
    async with started(tmp_path) as rig:
        first = await rig.ask(5, 42, start=True)
        call = await rig.workers.next_call()
        fed = {n: call.inputs[n].tolist() for n in ("START", "END", "READY", "CORRID")}
        assert fed == {"START": [[1]], "END": [[0]], "READY": [[1]], "CORRID": [[42]]}
        assert call.inputs["CORRID"].dtype == np.int64
        assert call.inputs["STATE_IN"].tolist() == [[0]]  # zeroed at the start
        accumulate(call)
        result = await first
        assert set(result.outputs) == {"OUTPUT"}  # the state stays in the gateway
        last = await rig.ask(3, 42, end=True)
        call = await rig.workers.next_call()
        assert call.inputs["START"].tolist() == [[0]]
        assert call.inputs["END"].tolist() == [[1]]
        assert call.inputs["STATE_IN"].tolist() == [[5]]
        accumulate(call)
        assert (await last).outputs["OUTPUT"].tolist() == [[8]]
        assert 42 not in rig.table  # dropped at its end


async def test_requests_of_one_sequence_run_one_after_another(tmp_path: Path) -> None:
    async with started(tmp_path, instances=2) as rig:
        assert await answer(rig, await rig.ask(1, 11, start=True)) == 1
        second, third = await rig.ask(2, 11), await rig.ask(3, 11)
        assert len(rig.pending()) == 1  # the third waits for the second's state
        assert await answer(rig, second) == 3
        assert await answer(rig, third) == 6


async def test_sequences_on_one_instance_share_a_batch(tmp_path: Path) -> None:
    async with started(tmp_path) as rig:
        a = await rig.ask(1, 1, start=True)  # runs; the others queue behind it
        b, c = await rig.ask(10, 2, start=True), await rig.ask(100, 3, start=True)
        assert await answer(rig, a) == 1
        call = await rig.workers.next_call()
        assert call.rows == 2  # b and c together, each with its own state row
        accumulate(call)
        assert [int((await t).outputs["OUTPUT"][0, 0]) for t in (b, c)] == [10, 100]
        a = await rig.ask(2, 1)
        b, c = await rig.ask(20, 2), await rig.ask(200, 3, end=True)
        assert await answer(rig, a) == 3
        call = await rig.workers.next_call()
        assert call.inputs["STATE_IN"].tolist() == [[10], [100]]
        assert call.inputs["END"].tolist() == [[0], [1]]
        accumulate(call)
        assert [int((await t).outputs["OUTPUT"][0, 0]) for t in (b, c)] == [30, 300]


async def test_a_sequence_idle_past_its_timeout_is_dropped(tmp_path: Path) -> None:
    async with started(tmp_path) as rig:
        assert await answer(rig, await rig.ask(1, 7, start=True)) == 1
        rig.clock.advance(4.9)  # within the 5 s idle timeout
        assert await answer(rig, await rig.ask(1, 7)) == 2
        rig.clock.advance(5.1)
        late = await rig.ask(1, 7)
        with pytest.raises(BadRequest) as dropped:
            await late
        assert "was idle 5.1 s, past the model's sequence idle timeout of 5 s" in str(dropped.value)
        assert "idle_timeout_ms" in str(dropped.value)
        assert len(rig.table) == 0  # its state went with it
        assert rig.pending() == []  # the model never saw the late request
        assert await answer(rig, await rig.ask(4, 7, start=True)) == 4  # a new start works


async def test_a_sequence_whose_worker_died_is_lost_not_restarted(tmp_path: Path) -> None:
    async with started(tmp_path, instances=2) as rig:
        task = await rig.ask(1, 21, start=True)
        call = await rig.workers.next_call()
        accumulate(call)
        await task
        call.worker.end("crashed")
        for _ in range(2):  # its next request, and any after it, are told why
            with pytest.raises(SequenceLost) as lost:
                await (await rig.ask(1, 21))
            assert lost.value.status == 410
            assert "sequence 21 of model 'm' is lost" in str(lost.value)
            assert "sequence_start" in str(lost.value)
        assert rig.pending() == []  # never silently run from zero state on the sibling
        assert await answer(rig, await rig.ask(6, 21, start=True)) == 6


async def test_a_sequence_request_is_not_retried_on_a_sibling(tmp_path: Path) -> None:
    async with started(tmp_path, instances=2) as rig:
        assert await answer(rig, await rig.ask(1, 22, start=True)) == 1
        task = await rig.ask(1, 22)
        call = await rig.workers.next_call()
        call.worker.end("crashed")
        with pytest.raises(SequenceLost) as lost:
            await task
        assert "its worker died while running this request" in str(lost.value)
        assert rig.pending() == []


async def test_bad_sequence_requests(tmp_path: Path) -> None:
    async with started(tmp_path) as rig:
        with pytest.raises(BadRequest, match="sequence 9 of model 'm' is not started"):
            await (await rig.ask(1, 9))
        with pytest.raises(BadRequest, match="takes its correlation id as INT64"):
            await (await rig.ask(1, "text-id", start=True))
        assert len(rig.table) == 0  # a start that failed never began
        x = np.ones((1, 1), np.int32)
        sent = InferenceRequest("m", {"INPUT": x, "START": x}, sequence=SequenceParams(1, True))
        with pytest.raises(BadRequest, match="input 'START' of model 'm' is fed by the gateway"):
            await rig.engine.infer(sent)
        with pytest.raises(BadRequest, match="needs parameters.sequence_id"):
            await rig.engine.infer(InferenceRequest("m", {"INPUT": x}))
        assert rig.pending() == []


def test_sequence_parameters_as_tritonclient_sends_them() -> None:
    assert sequence_params({}) is None
    assert sequence_params({"sequence_id": 0}) is None  # 0: no sequence, as in Triton
    assert sequence_params({"sequence_id": 5, "sequence_start": True}) == SequenceParams(
        5, True, False
    )
    assert sequence_params({"sequence_id": "abc", "sequence_end": True}) == SequenceParams(
        "abc", False, True
    )
    assert sequence_params({"sequence_id": "s" * 256}) == SequenceParams("s" * 256, False, False)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"sequence_id": 1.5}, "sequence_id must be a non-negative integer or a string"),
        ({"sequence_id": True}, "sequence_id must be"),
        ({"sequence_id": 1, "sequence_start": 1}, "sequence_start must be true or false"),
        ({"sequence_start": True}, "need a sequence_id"),
        # Ids are remembered after their sequence ends: one of megabytes kept megabytes.
        ({"sequence_id": "s" * 257}, "a string of 257 characters; a sequence id has at most 256"),
    ]
    for bad, words in cases:
        with pytest.raises(BadRequest, match=words):
            sequence_params(bad)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[sequence]\nstart = 1\n", "sequence.start: expected a string"),
        ("[sequence]\nstop = 'X'\n", "unknown key sequence.stop"),
        ("[sequence]\nidle_timeout_ms = 0\n", "sequence.idle_timeout_ms: expected a number >= 1"),
        ("[sequence]\n[[sequence.state]]\ninput = 'S'\n", "needs input and output"),
        ("[sequence]\nstart = 'S'\n[[sequence.state]]\ninput = 'S'\noutput = 'O'\n", "twice"),
    ],
)
def test_bad_sequence_tables_name_the_key(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "model.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        parse_model_config(path)


def test_an_empty_sequence_table_still_takes_sequences(tmp_path: Path) -> None:
    path = tmp_path / "model.toml"
    path.write_text("[sequence]\n")
    settings = parse_model_config(path).sequence
    assert settings is not None
    assert settings.idle_timeout_s == 1.0  # Triton's default max_sequence_idle_microseconds
    path.write_text("")
    assert parse_model_config(path).sequence is None


async def test_a_request_that_waited_out_a_restart_is_lost_too(tmp_path: Path) -> None:
    async with started(tmp_path) as rig:
        assert await answer(rig, await rig.ask(1, 31, start=True)) == 1
        other = await rig.ask(1, 32, start=True)  # runs; 31's next request queues behind it
        queued = await rig.ask(2, 31, cls="batch")  # a deadline of 30 s: it waits
        call = await rig.workers.next_call()
        assert len(rig.pending()) == 1
        call.worker.end("crashed")
        with pytest.raises(SequenceLost):
            await other
        instance = rig.engine.version("m").instances[0]
        while not instance.ready:  # the restart backoff runs on the FakeClock
            rig.clock.advance(0.25)
            await asyncio.sleep(0.01)
        late = await rig.workers.next_call()  # the new worker ran it, with carried state
        accumulate(late)
        with pytest.raises(SequenceLost, match="sequence 31 of model 'm' is lost"):
            await queued


async def test_an_idle_sequence_is_freed_without_another_request(tmp_path: Path) -> None:
    async with started(tmp_path, idle_timeout_ms=20) as rig:
        assert await answer(rig, await rig.ask(1, 41, start=True)) == 1
        assert 41 in rig.table
        rig.clock.advance(0.019)
        await asyncio.sleep(0.05)  # the timer looked: not idle long enough on the clock
        assert 41 in rig.table
        rig.clock.advance(0.002)
        await eventually(lambda: 41 not in rig.table, what="the idle sequence to be dropped")
        with pytest.raises(BadRequest, match="past the model's sequence idle timeout"):
            await (await rig.ask(1, 41))


async def test_live_sequences_are_bounded(tmp_path: Path) -> None:
    async with started(tmp_path) as rig:  # max_sequences = 3
        for sid in (51, 52, 53):
            assert await answer(rig, await rig.ask(1, sid, start=True)) == 1
        with pytest.raises(Overloaded, match="holds 3 live sequences, its limit") as full:
            await (await rig.ask(1, 54, start=True))
        assert full.value.retry_after_s is not None
        assert await answer(rig, await rig.ask(1, 53, start=True)) == 1  # restarting one is fine
        assert await answer(rig, await rig.ask(1, 52, end=True)) == 2
        assert await answer(rig, await rig.ask(7, 54, start=True)) == 7  # 52's place


def tensor_toml(kind: str, name: str, datatype: str) -> str:
    return f'[[{kind}]]\nname = "{name}"\ndatatype = "{datatype}"\nshape = [-1, 1]\n'


async def test_controls_take_the_model_s_own_datatypes(tmp_path: Path) -> None:
    toml = (
        tensor_toml("inputs", "INPUT", "INT32")
        + tensor_toml("inputs", "STATE_IN", "INT32")
        + tensor_toml("inputs", "START", "BOOL")
        + tensor_toml("inputs", "END", "FP32")
        + tensor_toml("inputs", "CORRID", "BYTES")
        + tensor_toml("outputs", "OUTPUT", "INT32")
        + tensor_toml("outputs", "STATE_OUT", "INT32")
        + '[sequence]\nstart = "START"\nend = "END"\ncorrid = "CORRID"\n'
        + '[[sequence.state]]\ninput = "STATE_IN"\noutput = "STATE_OUT"\n'
    )
    async with started(tmp_path, toml=toml) as rig:
        task = await rig.ask(1, "user-7", start=True, end=True)
        call = await rig.workers.next_call()
        assert call.inputs["START"].dtype == np.bool_
        assert call.inputs["START"].tolist() == [[True]]
        assert call.inputs["END"].dtype == np.float32
        assert call.inputs["END"].tolist() == [[1.0]]
        assert call.inputs["CORRID"].tolist() == [[b"user-7"]]
        accumulate(call)
        assert (await task).outputs["OUTPUT"].tolist() == [[1]]


async def test_a_sequence_table_naming_a_missing_input_says_so(tmp_path: Path) -> None:
    toml = (
        tensor_toml("inputs", "INPUT", "INT32")
        + tensor_toml("inputs", "STATE_IN", "INT32")
        + tensor_toml("outputs", "OUTPUT", "INT32")
        + tensor_toml("outputs", "STATE_OUT", "INT32")
        + '[sequence]\nstart = "BEGIN"\n'
    )
    async with started(tmp_path, toml=toml) as rig:
        with pytest.raises(ModelFailed, match="names input 'BEGIN', which the model does not"):
            await (await rig.ask(1, 3, start=True))
        assert rig.pending() == []


async def test_a_sequence_is_its_tenants_own(tmp_path: Path) -> None:
    """The same sequence id from two tenants names two sequences: a tenant can neither
    continue another's (400: not started, as for any unknown id) nor restart it."""
    async with started(tmp_path) as rig:
        tenants = rig.engine.context.tenants
        tenants.configure([Tenant("a"), Tenant("b")], (), True)

        def ask_as(name: str, value: int, start: bool = False) -> asyncio.Task[InferenceResult]:
            x = np.full((1, 1), value, np.int32)
            request = InferenceRequest("m", {"INPUT": x}, sequence=SequenceParams(7, start, False))
            return asyncio.create_task(rig.engine.infer(request, tenants.get(name)))

        assert await answer(rig, ask_as("a", 5, start=True)) == 5
        with pytest.raises(BadRequest, match="is not started"):
            await ask_as("b", 1)  # a's sequence 7 is not b's
        assert await answer(rig, ask_as("b", 100, start=True)) == 100  # b's own 7
        assert await answer(rig, ask_as("a", 1)) == 6  # a's state, untouched by b's start
        assert await answer(rig, ask_as("b", 1)) == 101


@pytest.mark.parametrize(
    ("datatype", "low", "high"),
    [
        ("INT32", -(2**31), 2**31 - 1),
        ("UINT32", 0, 2**32 - 1),
        ("INT64", -(2**63), 2**63 - 1),
        ("UINT64", 0, 2**64 - 1),
    ],
)
async def test_a_sequence_id_its_corrid_cannot_hold_is_a_400_and_holds_no_place(
    tmp_path: Path, datatype: str, low: int, high: int
) -> None:
    toml = MODEL_TOML.format(instances=1, idle_timeout_ms=5000)
    toml = toml.replace('"CORRID"\ndatatype = "INT64"', f'"CORRID"\ndatatype = "{datatype}"')
    async with started(tmp_path, toml=toml) as rig:  # max_sequences = 3
        for sid in (high + 1, high + 2, high + 3, 2**100):
            with pytest.raises(BadRequest) as bad:
                await (await rig.ask(1, sid, start=True))
            assert f"sequence_id {sid} is out of range for model 'm'" in str(bad.value)
            assert f"{datatype} (input 'CORRID'): from {low} to {high}" in str(bad.value)
        assert len(rig.table) == 0
        assert rig.pending() == []  # the model never saw them
        task = await rig.ask(1, high, start=True)
        call = await rig.workers.next_call()
        assert call.inputs["CORRID"].tolist() == [[high]]
        accumulate(call)
        await task
        for sid in (1, 2):  # the other two places of max_sequences are free too
            assert await answer(rig, await rig.ask(1, sid, start=True)) == 1


async def test_a_corrid_of_no_integer_datatype_is_the_model_s_fault(tmp_path: Path) -> None:
    toml = MODEL_TOML.format(instances=1, idle_timeout_ms=5000)
    toml = toml.replace('"CORRID"\ndatatype = "INT64"', '"CORRID"\ndatatype = "FP32"')
    async with started(tmp_path, toml=toml) as rig:
        with pytest.raises(ModelFailed, match="corrid names input 'CORRID' of datatype FP32"):
            await (await rig.ask(1, 5, start=True))
        assert len(rig.table) == 0


async def test_a_huge_batch_of_empty_rows_is_a_400_before_any_control_is_built(
    tmp_path: Path,
) -> None:
    """[2**50, 0] holds no elements, but START/END/READY/CORRID/STATE_IN of 2**50 rows
    would not fit in memory: the request's shapes are checked first."""
    async with started(tmp_path) as rig:
        for start in (True, False):
            empty = np.zeros((2**50, 0), np.int32)
            request = InferenceRequest("m", {"INPUT": empty}, sequence=SequenceParams(8, start))
            with pytest.raises(
                BadRequest, match=r"input 'INPUT' has shape \[1125899906842624, 0\]"
            ):
                await rig.engine.infer(request)
        assert len(rig.table) == 0
        assert rig.pending() == []


async def test_a_sequence_continues_after_a_bad_request(tmp_path: Path) -> None:
    """A request refused for its inputs changes nothing: the sequence and its state stay."""
    async with started(tmp_path) as rig:
        assert await answer(rig, await rig.ask(5, 9, start=True)) == 5
        wrong = np.ones((1, 2), np.int32)
        request = InferenceRequest("m", {"INPUT": wrong}, sequence=SequenceParams(9, True, True))
        with pytest.raises(BadRequest, match="input 'INPUT' has shape"):
            await rig.engine.infer(request)
        assert await answer(rig, await rig.ask(1, 9, end=True)) == 6


async def test_a_start_or_end_that_fails_with_any_error_holds_no_place(tmp_path: Path) -> None:
    """Not only the engine's own errors: a bug's exception in a step must not leave its
    sequence in the table, where it would hold a place of max_sequences."""

    async def bug(request: InferenceRequest) -> InferenceResult:
        raise RuntimeError("a bug")

    async with started(tmp_path) as rig:
        served = rig.engine.version("m")
        x = np.ones((1, 1), np.int32)
        assert await answer(rig, await rig.ask(1, 12, start=True)) == 1
        for sid, start, end in ((11, True, False), (12, False, True)):
            request = InferenceRequest("m", {"INPUT": x}, sequence=SequenceParams(sid, start, end))
            with pytest.raises(RuntimeError, match="a bug"):
                await infer_in_sequence(served, request, bug, DEFAULT_TENANT)
        assert len(rig.table) == 0


async def test_a_start_or_end_whose_client_left_holds_no_place(tmp_path: Path) -> None:
    """A step cancelled while it waits for its batch (its client left: server/departure.py)
    ends a start or an end as an error does: a start left in the table would hold a place
    of max_sequences until its idle timeout."""
    async with started(tmp_path) as rig:
        assert await answer(rig, await rig.ask(1, 12, start=True)) == 1
        for sid, start, end in ((11, True, False), (12, False, True)):
            step = await rig.ask(1, sid, start=start, end=end)
            await rig.workers.next_call()  # its batch is on the worker; its caller leaves
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
        assert len(rig.table) == 0
