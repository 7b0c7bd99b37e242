"""Sequences through tritonclient against the real server: Triton's sequence example
flow (two sequences interleaved, start and end flags) on a model whose OUTPUT is INPUT plus
the START flag, and an accumulator whose running sum lives in implicit state."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import write_profile
from tests.sequence_models import (
    ACCUMULATOR_TOML,
    CORRID_SUM_TOML,
    START_FLAG_TOML,
    make_accumulator,
    make_corrid_sum,
    make_start_flag,
)
from tests.server import ServerProcess
from tests.triton_models import make_simple


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("sequences")
    models = folder / "models"
    make_start_flag(models / "simple_sequence" / "1" / "model.onnx")
    (models / "simple_sequence" / "model.toml").write_text(START_FLAG_TOML)
    make_accumulator(models / "accumulator" / "1" / "model.onnx")
    (models / "accumulator" / "model.toml").write_text(ACCUMULATOR_TOML)
    make_simple(models / "simple" / "1" / "model.onnx")
    make_corrid_sum(models / "seq32" / "1" / "model.onnx")
    (models / "seq32" / "model.toml").write_text(CORRID_SUM_TOML)
    proc = ServerProcess(models, write_profile(folder), folder / "server.log").start()
    yield proc
    proc.stop()


def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def send(
    c: httpclient.InferenceServerClient,
    model: str,
    value: int,
    sequence_id: int | str,
    start: bool = False,
    end: bool = False,
) -> int:
    """One request of a sequence, as Triton's simple_http_sequence_sync_infer_client."""
    data = np.full((1, 1), value, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT", list(data.shape), "INT32")]
    inputs[0].set_data_from_numpy(data)
    outputs = [httpclient.InferRequestedOutput("OUTPUT")]
    result = c.infer(
        model,
        inputs,
        outputs=outputs,
        sequence_id=sequence_id,
        sequence_start=start,
        sequence_end=end,
    )
    return int(result.as_numpy("OUTPUT")[0][0])


VALUES = [11, 7, 5, 3, 2, 0, 1]


@pytest.mark.parametrize("ids", [(1000, 1001), ("seq-a", "seq-b")])
def test_triton_sequence_example_flow(server: ServerProcess, ids: tuple[int, int]) -> None:
    c = client(server)
    seq0, seq1 = ids
    results0 = [send(c, "simple_sequence", 0, seq0, start=True)]
    results1 = [send(c, "simple_sequence", 100, seq1, start=True)]
    for i, value in enumerate(VALUES):
        end = i == len(VALUES) - 1
        results0.append(send(c, "simple_sequence", value, seq0, end=end))
        results1.append(send(c, "simple_sequence", -value, seq1, end=end))
    # What the example checks: START is 1 on the first request only.
    assert results0 == [1, *VALUES]
    assert results1 == [101, *(-v for v in VALUES)]
    with pytest.raises(InferenceServerException) as ended:  # its end dropped it
        send(c, "simple_sequence", 1, seq0)
    assert ended.value.status() == "400"
    assert "is not started" in str(ended.value)


def test_accumulator_keeps_two_interleaved_sequences_apart(server: ServerProcess) -> None:
    c = client(server)
    a = [send(c, "accumulator", 1, 7, start=True)]
    b = [send(c, "accumulator", 100, "other", start=True)]
    for value in (2, 3, 4):
        a.append(send(c, "accumulator", value, 7))
        b.append(send(c, "accumulator", value * 100, "other"))
    a.append(send(c, "accumulator", 5, 7, end=True))
    assert a == [1, 3, 6, 10, 15]
    assert b == [100, 300, 600, 1000]
    # A new start is zeroed, whatever the id carried before.
    assert send(c, "accumulator", 9, "other", start=True) == 9
    assert send(c, "accumulator", 1, 7, start=True, end=True) == 1


def test_the_state_output_is_not_returned_unless_asked(server: ServerProcess) -> None:
    c = client(server)
    data = np.full((1, 1), 4, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT", [1, 1], "INT32")]
    inputs[0].set_data_from_numpy(data)
    result = c.infer("accumulator", inputs, sequence_id=55, sequence_start=True)
    assert result.as_numpy("STATE_OUT") is None
    assert result.as_numpy("OUTPUT").tolist() == [[4]]


def test_errors_a_client_sees(server: ServerProcess) -> None:
    c = client(server)
    with pytest.raises(InferenceServerException) as unknown:
        send(c, "accumulator", 1, 424242)
    assert unknown.value.status() == "400"
    assert "sequence 424242 of model 'accumulator' is not started" in str(unknown.value)
    assert "sequence_start" in str(unknown.value)
    # A model without [sequence] says so, instead of answering as if alone.
    data = np.ones((1, 16), dtype=np.int32)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(data)
    with pytest.raises(InferenceServerException) as plain:
        c.infer("simple", inputs, sequence_id=3, sequence_start=True)
    assert plain.value.status() == "400"
    assert "model 'simple' does not take sequences" in str(plain.value)
    # A sequence model asked without a sequence id.
    one = httpclient.InferInput("INPUT", [1, 1], "INT32")
    one.set_data_from_numpy(np.ones((1, 1), dtype=np.int32))
    with pytest.raises(InferenceServerException) as alone:
        c.infer("accumulator", [one])
    assert alone.value.status() == "400"
    assert "needs parameters.sequence_id" in str(alone.value)


def test_triton_tools_see_a_sequence_model(server: ServerProcess) -> None:
    c = client(server)
    assert "sequence" in c.get_server_metadata()["extensions"]
    config = c.get_model_config("accumulator")
    assert config["sequence_batching"] == {
        "max_sequence_idle_microseconds": 600_000_000,
        "control_input": [],
        "state": [
            {
                "input_name": "STATE_IN",
                "output_name": "STATE_OUT",
                "data_type": "TYPE_INT32",
                "dims": [1],
            }
        ],
    }
    assert "dynamic_batching" not in config
    # The gateway's own tensors are not the client's to send or read, as in Triton.
    assert [t["name"] for t in config["input"]] == ["INPUT"]
    assert [t["name"] for t in config["output"]] == ["OUTPUT"]
    metadata = c.get_model_metadata("simple_sequence")
    assert [t["name"] for t in metadata["inputs"]] == ["INPUT"]
    controls = c.get_model_config("simple_sequence")["sequence_batching"]["control_input"]
    assert controls == [
        {
            "name": "START",
            "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}],
        }
    ]


def test_a_sequence_id_its_corrid_cannot_hold_is_a_400_and_holds_no_place(
    server: ServerProcess,
) -> None:
    c = client(server)
    for sid in (2**31, 2**31 + 1, 2**32):  # CORRID is INT32; seq32 holds 2 sequences
        with pytest.raises(InferenceServerException) as bad:
            send(c, "seq32", 0, sid, start=True)
        assert bad.value.status() == "400"
        assert f"sequence_id {sid} is out of range for model 'seq32'" in str(bad.value)
        assert "INT32 (input 'CORRID'): from -2147483648 to 2147483647" in str(bad.value)
    # None of them kept a place of max_sequences: two sequences start.
    assert send(c, "seq32", 0, 2**31 - 1, start=True) == 2**31 - 1
    assert send(c, "seq32", 5, 7, start=True) == 12
    assert send(c, "seq32", 0, 2**31 - 1, end=True) == 2**31 - 1
    assert send(c, "seq32", 1, 7, end=True) == 8


def test_a_huge_batch_of_empty_rows_is_a_400_and_holds_no_place(server: ServerProcess) -> None:
    """[2**40, 0] holds no elements, but control tensors of 2**40 rows would not fit."""
    for sid in (61, 62, 63):  # seq32 holds 2 sequences
        body = {
            "parameters": {"sequence_id": sid, "sequence_start": True},
            "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [2**40, 0], "data": []}],
        }
        response = httpx.post(f"{server.url}/v2/models/seq32/infer", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert "input 'INPUT' has shape [1099511627776, 0]" in response.json()["error"]
    c = client(server)
    assert c.is_server_ready()
    assert send(c, "seq32", 1, 64, start=True) == 65
    assert send(c, "seq32", 1, 65, start=True) == 66
    assert send(c, "seq32", 1, 64, end=True) == 65
    assert send(c, "seq32", 1, 65, end=True) == 66
