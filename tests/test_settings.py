"""Settings declared once (infergate/settings/): every declared bound is what the profile and
model.toml readers enforce, with the file, key, expectation and value named; unknown keys
are named in every table; the admin API and the CLI take their keys from the same
declarations; and README.md's reference is what the declarations generate."""

from __future__ import annotations

import re
from pathlib import Path

import annotated_types
import httpx
import pytest
import typer
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

from infergate.cli.main import app as cli
from infergate.cli.settings import parse_settings
from infergate.engine.repository.modelconfig import parse_model_config
from infergate.errors import ConfigError
from infergate.profile import load_profile
from infergate.server.gateway import build_gateway
from infergate.settings import reference
from infergate.settings.declare import Section, describe, keys
from infergate.settings.edits import editable
from tests.conftest import write_profile

# Each table of the reference: (which file, the table) -> (the text that opens it, keys it
# needs besides the one tested, the key's prefix in errors)
Opening = tuple[str, dict[str, str], str]
OPENING: dict[tuple[str, str], Opening] = {
    ("profile", "[server]"): ("[server]", {}, "server."),
    ("profile", "[batching]"): ("[batching]", {}, "batching."),
    ("profile", "[classes.NAME]"): (
        "[classes.gold]",
        {"rank": "0", "deadline_ms": "10"},
        "classes.gold.",
    ),
    ("profile", "[breaker], [breaker.models.NAME]"): (
        "[breaker.models.m]",
        {},
        "breaker.models.m.",
    ),
    ("profile", "[tenants.NAME]"): ("[tenants.acme]", {}, "tenants.acme."),
    ("profile", "[devices]"): ("[devices]", {}, "devices."),
    ("profile", "[cluster]"): ("[cluster]", {}, "cluster."),
    ("model.toml", "top level"): ("", {}, ""),
    ("model.toml", "[version_policy]"): ("[version_policy]", {}, "version_policy."),
    ("model.toml", "[batching]"): ("[batching]", {}, "batching."),
    ("model.toml", "[breaker]"): ("[breaker]", {}, "breaker."),
    ("model.toml", "[warmup]"): ("[warmup]", {}, "warmup."),
    ("model.toml", "[sequence]"): ("[sequence]", {}, "sequence."),
    ("model.toml", "[[sequence.state]]"): (
        "[sequence]\n[[sequence.state]]",
        {"input": '"S_IN"', "output": '"S_OUT"'},
        "sequence.state[0].",
    ),
    ("model.toml", "[[inputs]], [[outputs]]"): (
        "[[inputs]]",
        {"name": '"x"', "datatype": '"FP32"', "shape": "[1]"},
        "inputs[0].",
    ),
    ("model.toml", "[remote]"): (
        'runtime = "remote"\n[remote]',
        {"endpoints": '["http://h:8000"]'},
        "remote.",
    ),
}


def _text(file: str, table: str, key: str, value: object) -> tuple[str, str]:
    """A file whose table sets `key = value` (and what else it needs); the key's prefix."""
    opening, needs, prefix = OPENING[(file, table)]
    lines = [opening, *(f"{k} = {v}" for k, v in needs.items() if k != key), f"{key} = {value}"]
    return "\n".join(lines) + "\n", prefix


def _read(tmp_path: Path, file: str, text: str) -> Path:
    """Write `text` as a profile or a model.toml and read it; returns the file."""
    if file == "profile":
        path = write_profile(tmp_path, text)
        load_profile(path)
    else:
        path = tmp_path / "model.toml"
        path.write_text(text)
        parse_model_config(path)
    return path


def _outside(info: FieldInfo) -> int | float | None:
    """A value just past the setting's bounds, None when it has none."""
    whole = info.annotation in (int, int | None)
    for m in info.metadata:
        if isinstance(m, annotated_types.Le):
            most = float(m.le)  # type: ignore[arg-type]  # a number, as declared
            return int(most) + 1 if whole else most * 2 + 1
        if isinstance(m, annotated_types.Ge):
            least = float(m.ge)  # type: ignore[arg-type]  # a number, as declared
            if whole:
                return int(least) - 1
            return least / 2 if least > 0 else -1.0
    return None


BOUNDED = [
    pytest.param(file, table, section, key, id=f"{file}:{table}:{key}")
    for file, table, section, _ in reference.ENTRIES
    for key, info in keys(section).items()
    if _outside(info) is not None
]


@pytest.mark.parametrize(("file", "table", "section", "key"), BOUNDED)
def test_every_declared_bound_is_enforced_and_named(
    tmp_path: Path, file: str, table: str, section: type[Section], key: str
) -> None:
    info = keys(section)[key]
    bad = _outside(info)
    text, prefix = _text(file, table, key, bad)
    with pytest.raises(ConfigError) as caught:
        _read(tmp_path, file, text)
    message = str(caught.value)
    assert str(tmp_path) in message
    assert f"{prefix}{key}: expected {describe(info)}, got {bad}" in message


@pytest.mark.parametrize(
    ("file", "table"), [pytest.param(f, t, id=f"{f}:{t}") for f, t, _, _ in reference.ENTRIES]
)
def test_an_unknown_key_is_named_in_every_table(tmp_path: Path, file: str, table: str) -> None:
    text, prefix = _text(file, table, "nope", 1)
    with pytest.raises(
        ConfigError, match=re.escape(f"unknown key {prefix}nope (known keys here: ")
    ):
        _read(tmp_path, file, text)


def test_every_table_of_the_reference_is_tested() -> None:
    assert {(f, t) for f, t, _, _ in reference.ENTRIES} == set(OPENING)


def test_the_readme_reference_is_what_the_declarations_generate() -> None:
    text = reference.README.read_text()
    assert reference.in_readme(text) == reference.markdown(), (
        "README.md's settings reference is stale: run "
        "`python -m infergate.settings.reference --write`"
    )


def test_the_cli_reads_keys_and_lists_as_declared() -> None:
    assert parse_settings(["models=a,b", "weight=2", "rps=null", "class=gold"], "tenant") == {
        "models": ["a", "b"],
        "weight": 2,
        "rps": None,
        "class": "gold",
    }
    with pytest.raises(typer.BadParameter, match="unknown setting 'window'; known: backoff_"):
        parse_settings(["window=1"], "breaker")
    with pytest.raises(typer.BadParameter, match="unknown setting 'api_keys'"):
        parse_settings(['api_keys=["sha256:00"]'], "tenant")  # keys are made, never set


@pytest.mark.parametrize("noun", ["tenant", "breaker"])
def test_the_cli_help_names_every_setting_an_edit_takes(noun: str) -> None:
    result = CliRunner().invoke(cli, [noun, "set", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    help_text = " ".join(result.stdout.split())
    assert [k for k in editable(noun) if k not in help_text] == []


async def test_admin_edits_are_checked_by_the_declarations(tmp_path: Path) -> None:
    path = write_profile(tmp_path, "# kept\n[tenants.default]\nrps = 10\n")
    (tmp_path / "models").mkdir()
    engine, app, _ = build_gateway(load_profile(path), tmp_path / "models")
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            url = "/admin/tenants/default"
            refused = await client.patch(url, json={"rps": -3})
            assert refused.status_code == 400
            assert "tenants.default.rps: expected a number >= 0 (req/s), got -3" in refused.text
            refused = await client.patch(url, json={"models": "a"})
            assert "tenants.default.models: expected a list of strings" in refused.text
            assert "rps = 10" in path.read_text()  # untouched
            weighted = await client.patch(url, json={"weight": 2, "rps": None})
            assert weighted.status_code == 200, weighted.text
            assert weighted.json()["rps"] is None  # the limit removed: none, as declared
            assert "weight = 2" in path.read_text()
            assert "rps" not in path.read_text()
            assert "# kept" in path.read_text()
            breaker = await client.patch("/admin/breakers/m", json={"window_seconds": 0})
            assert breaker.status_code == 400
            assert "breaker.models.m.window_seconds: expected a number >= 0.1" in breaker.text
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nport = 70000\n", "server.port: expected an integer from 0 to 65535, got 70000"),
        (
            f'[server]\nserver_name = "{"x" * 5000}"\n',
            "server.server_name: expected at most 4096 characters, got 5000",
        ),
        (
            "[tenants.default]\nmodels = [" + ", ".join(['"a"'] * 2000) + "]\n",
            "tenants.default.models: expected a list of at most 1024 items, got 2000 items",
        ),
    ],
)
def test_strings_lists_and_ports_are_bounded(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_profile(write_profile(tmp_path, text))


def test_an_error_quotes_a_huge_value_briefly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_profile(write_profile(tmp_path, f'[tenants.default]\nrps = "{"A" * 100_000}"\n'))
    assert "tenants.default.rps: expected a number, got 'AAA" in str(raised.value)
    assert len(str(raised.value)) < 400


def test_the_profile_records_hold_every_declared_key() -> None:
    """A key declared in a section but missing from the record it fills would fail every
    profile load with a TypeError instead of a ConfigError."""
    import dataclasses

    from infergate.profile import DeviceSettings, ServerSettings
    from infergate.settings.profile_sections import DevicesSection, ServerSection

    for record, section in ((ServerSettings, ServerSection), (DeviceSettings, DevicesSection)):
        fields = {f.name for f in dataclasses.fields(record)}
        assert set(section.model_fields) == fields, record.__name__
