"""Triton's statistics extension, read with tritonclient after real inferences."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.server import ServerProcess


def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def simple_inputs(rows: int) -> list[httpclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [rows, 16], "INT32")
        tensor.set_data_from_numpy(np.ones((rows, 16), dtype=np.int32))
        inputs.append(tensor)
    return inputs


def _simple(c: httpclient.InferenceServerClient) -> dict[str, Any]:
    stats: dict[str, Any] = c.get_inference_statistics("simple")["model_stats"][0]
    return stats


def test_counts_durations_and_batch_sizes(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    before = _simple(c)  # other tests share this server: compare with what it had
    before_ms = time.time_ns() // 1_000_000
    for rows in (1, 1, 3):  # one at a time: each runs in a batch of its own rows
        c.infer("simple", simple_inputs(rows))
    stats = c.get_inference_statistics("simple")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("simple", "1")]
    s = stats[0]
    assert s["inference_count"] - before["inference_count"] == 5  # rows
    assert s["execution_count"] - before["execution_count"] == 3
    assert s["last_inference"] >= before_ms
    now, then = s["inference_stats"], before["inference_stats"]
    for key in ("success", "queue", "compute_infer", "compute_input", "compute_output"):
        assert now[key]["count"] - then[key]["count"] == 3
    assert now["fail"]["count"] == then["fail"]["count"]
    success_ns = now["success"]["ns"] - then["success"]["ns"]
    assert success_ns >= now["compute_infer"]["ns"] - then["compute_infer"]["ns"] > 0

    def by_size(doc: dict[str, Any]) -> dict[int, int]:
        return {b["batch_size"]: b["compute_infer"]["count"] for b in doc["batch_stats"]}

    sizes, old = by_size(s), by_size(before)
    assert sizes[1] - old.get(1, 0) == 2
    assert sizes[3] - old.get(3, 0) == 1


def test_failures_are_counted(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    mode = httpclient.InferInput("mode", [1], "INT64")
    mode.set_data_from_numpy(np.array([3], dtype=np.int64))  # anything but 0 fails
    with pytest.raises(InferenceServerException):
        c.infer("flaky", [mode])
    inference = c.get_inference_statistics("flaky", "1")["model_stats"][0]["inference_stats"]
    assert inference["fail"]["count"] == 1
    assert inference["fail"]["ns"] > 0
    assert inference["success"]["count"] == 0


def test_all_models_and_unknown_ones(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    names = {s["name"] for s in c.get_inference_statistics()["model_stats"]}
    assert {"simple", "simple_fixed", "flaky"} <= names
    with pytest.raises(InferenceServerException) as caught:
        c.get_inference_statistics("nope")
    assert "Request for unknown model: 'nope' is not found" in caught.value.message()
