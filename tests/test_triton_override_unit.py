"""Triton's `parameters.config` mapped onto model.toml's fields, in-process."""

from __future__ import annotations

import pytest

from infergate.engine.repository.config_override import apply_override, parse_override
from infergate.engine.repository.spec import BatchingOverrides, ModelConfig, VersionPolicy
from infergate.errors import BadRequest


def overridden(text: str, config: ModelConfig | None = None) -> ModelConfig:
    doc = parse_override("m", text, "onnxruntime_onnx")
    return apply_override("m", config or ModelConfig(), doc)


def test_each_field_lands_on_its_model_toml_counterpart() -> None:
    config = overridden(
        '{"name": "m", "backend": "onnxruntime", "max_batch_size": 8,'
        ' "dynamic_batching": {"max_queue_delay_microseconds": 1500},'
        ' "instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"count": 1, "kind": "KIND_CPU"}],'
        ' "version_policy": {"all": {}}}'
    )
    assert config.batching == BatchingOverrides(max_batch_size=8, max_queue_delay_ms=1.5)
    assert config.instances == 3
    assert config.device == "cpu"
    assert config.version_policy == VersionPolicy(all=True)


def test_what_the_override_leaves_out_stays_as_model_toml_says() -> None:
    base = ModelConfig(instances=4, batching=BatchingOverrides(max_queue_size=7), device="cuda:1")
    config = overridden('{"version_policy": {"latest": {"num_versions": "2"}}}', base)
    assert config.instances == 4
    assert config.batching.max_queue_size == 7
    assert config.device == "cuda:1"
    assert config.version_policy == VersionPolicy(latest=2)


def test_kind_gpu_lets_a_cpu_model_take_a_gpu() -> None:
    config = overridden('{"instance_group": [{"kind": "KIND_GPU"}]}', ModelConfig(device="cpu"))
    assert config.device == "auto"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[1]", "JSON object"),
        ('{"max_batch_size": -1}', "'max_batch_size' must be an integer >= 0"),
        ('{"max_batch_size": true}', "max_batch_size"),
        ('{"instance_group": {}}', "'instance_group' must be a non-empty list"),
        ('{"instance_group": [{"kind": "KIND_TPU"}]}', "instance_group[0].kind"),
        ('{"instance_group": [{"gpus": [0]}]}', "instance_group[0].gpus"),
        ('{"instance_group": [{"kind": "KIND_CPU"}, {"kind": "KIND_GPU"}]}', "mixes kinds"),
        ('{"version_policy": {"latest": {}, "all": {}}}', "one of latest, all or specific"),
        ('{"version_policy": {"specific": {"versions": []}}}', "specific.versions"),
        ('{"backend": "pytorch"}', "'backend' is 'pytorch'"),
        ('{"sequence_batching": {}}', "'sequence_batching' is not supported"),
        # Digits int() does not take (superscript, or thousands of them): a 400, not a 500.
        ('{"max_batch_size": "\u00b2"}', "'max_batch_size' must be an integer >= 0"),
        ('{"max_batch_size": "' + "1" * 5000 + '"}', "got '11111111111"),
        ('{"instance_group": [{"count": 1000000000}]}', "from 1 to 256"),
        (
            '{"instance_group": [{"count": 200}, {"count": 100}]}',
            "asks for 300 instances in all; a model has at most 256",
        ),
        ('{"name": ' + "[" * 1000 + "1" + "]" * 1000 + "}", "'name' is [[[[...]]]]"),
        # No preferred sizes here: accepted and ignored, they changed nothing without a word.
        ('{"dynamic_batching": {"preferred_batch_size": [4, 8]}}', "has no preferred sizes"),
        ('{"dynamic_batching": {"preferred_batch_size": "x"}}', "preferred_batch_size' is 'x'"),
    ],
)
def test_refusals_name_the_field(text: str, names: str) -> None:
    with pytest.raises(BadRequest) as caught:
        overridden(text)
    assert str(caught.value).startswith("failed to load 'm': ")
    assert names in str(caught.value)


def test_the_config_must_be_a_string() -> None:
    with pytest.raises(BadRequest, match="parameters.config must be a JSON string"):
        parse_override("m", {"max_batch_size": 1}, None)


def test_an_empty_preferred_batch_size_comes_back_as_the_config_endpoint_shows_it() -> None:
    config = overridden('{"dynamic_batching": {"preferred_batch_size": []}}')
    assert config.batching == BatchingOverrides()
