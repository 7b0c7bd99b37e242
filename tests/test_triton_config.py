"""Triton's model configuration extension and the wordings Triton's clients check, through
tritonclient against a real server."""

from __future__ import annotations

import json

import httpx
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.server import ServerProcess
from tests.triton_models import TRITON_MODELS


def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def test_config_of_a_batching_model_drops_the_batch_dimension(
    triton_server: ServerProcess,
) -> None:
    config = client(triton_server).get_model_config("simple")
    assert config["name"] == "simple"
    assert config["platform"] == "onnxruntime_onnx"
    assert config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 32  # the profile's default batching
    assert config["input"] == [
        {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
        {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]},
    ]
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1"]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    (group,) = config["instance_group"]
    assert group["count"] == 1
    placed = triton_server.model("simple")["versions"][0]["instances"][0]["placed_on"]
    assert group["kind"] == ("KIND_GPU" if placed.startswith("cuda:") else "KIND_CPU")
    assert config["version_policy"] == {"latest": {"num_versions": 1}}


def test_config_of_a_model_without_a_batch_dimension(triton_server: ServerProcess) -> None:
    config = client(triton_server).get_model_config("simple_fixed", "1")
    assert config["max_batch_size"] == 0
    assert config["input"][0]["dims"] == [1, 16]
    assert "dynamic_batching" not in config


def test_load_with_a_config_override_changes_what_serves(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    # Triton's model-control example sends the size as a string, as protobuf's JSON allows.
    override = {
        "max_batch_size": "16",
        "dynamic_batching": {"max_queue_delay_microseconds": 500},
        "instance_group": [{"kind": "KIND_CPU", "count": 2}],
        "version_policy": {"latest": {"num_versions": 1}},
    }
    c.load_model("tunable", config=json.dumps(override))
    config = c.get_model_config("tunable")
    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert config["instance_group"][0]["count"] == 2
    assert len(triton_server.worker_pids("tunable")) == 2  # really two workers
    c.load_model("tunable")  # a plain load goes back to the files
    assert c.get_model_config("tunable")["max_batch_size"] == 32
    assert c.get_model_config("tunable")["instance_group"][0]["count"] == 1


def test_version_policy_override(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    c.load_model("versioned", config='{"version_policy": {"specific": {"versions": [1, 3]}}}')
    index = {(m["name"], m.get("version")) for m in c.get_model_repository_index()}
    assert ("versioned", "1") in index
    assert ("versioned", "3") in index
    assert c.get_model_config("versioned")["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert c.is_model_ready("versioned", "1")
    c.load_model("versioned")
    assert not c.is_model_ready("versioned", "1")  # back to the latest only
    assert c.is_model_ready("versioned", "3")


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ('"parameters": {"config": {{"max_batch_size": "16"}}}', "not valid JSON"),
        ('{"max_batch_size": "many"}', "max_batch_size"),
        ('{"optimization": {}}', "optimization"),
        ('{"dynamic_batching": {"priority_levels": 2}}', "dynamic_batching.priority_levels"),
        ('{"instance_group": [{"count": 0}]}', "instance_group[0].count"),
        ('{"version_policy": {"newest": {}}}', "version_policy.newest"),
        ('{"platform": "tensorrt_plan"}', "platform"),
        ('{"name": "other"}', "name"),
    ],
)
def test_a_bad_override_is_a_400_naming_the_field(
    triton_server: ServerProcess, config: str, names: str
) -> None:
    response = httpx.post(
        f"{triton_server.url}/v2/repository/models/tunable/load",
        json={"parameters": {"config": config}},
    )
    assert response.status_code == 400
    message = response.json()["error"]
    assert "failed to load 'tunable'" in message
    assert names in message
    assert client(triton_server).is_model_ready("tunable")  # what served still serves


def test_an_override_that_cannot_load_keeps_what_serves(triton_server: ServerProcess) -> None:
    c = client(triton_server)
    with pytest.raises(InferenceServerException) as caught:
        c.load_model("versioned", config='{"version_policy": {"specific": {"versions": [9]}}}')
    assert caught.value.status() == "400"
    assert "failed to load 'versioned'" in caught.value.message()
    assert "selects none of the versions on disk (1, 2, 3)" in caught.value.message()
    assert c.is_model_ready("versioned", "3")
    c.load_model("versioned")  # and a plain load is as before
    assert c.get_model_config("versioned")["version_policy"] == {"latest": {"num_versions": 1}}


def test_the_index_then_loading_a_model_not_in_the_repository(
    triton_server: ServerProcess,
) -> None:
    """As Triton's model-control example checks: the index has exactly the models in the
    folder, and a name not among them fails to load."""
    index = client(triton_server).get_model_repository_index()
    assert sorted({m["name"] for m in index}) == sorted(TRITON_MODELS)
    assert len(index) == len(TRITON_MODELS)  # one row each: every model serves one version
    with pytest.raises(InferenceServerException) as caught:
        client(triton_server).load_model("wrong_model_name")
    assert caught.value.status() == "400"
    assert "failed to load 'wrong_model_name'" in caught.value.message()


def test_unknown_model_wording(triton_server: ServerProcess) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client(triton_server).get_model_metadata("wrong_model_name")
    message = caught.value.message()
    assert message.startswith("Request for unknown model: 'wrong_model_name' is not found")
    assert "Hint:" in message  # ours, after Triton's words


def test_server_metadata_lists_the_extensions(triton_server: ServerProcess) -> None:
    extensions = client(triton_server).get_server_metadata()["extensions"]
    for name in ("model_configuration", "statistics", "system_shared_memory", "classification"):
        assert name in extensions
