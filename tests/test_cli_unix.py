"""The CLI as a Unix tool, through a real server: help with examples, text shown as
written, whole tables off a terminal, --format, one JSON shape per command, finding the
server, separate tenant and admin tokens, `key new`, one-line mistakes with exit codes,
and `model list` showing what failed and why."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from infergate.cli.main import app
from infergate.client import default_url, project_profile_unread
from infergate.engine.admission.tenants import hash_key
from tests.conftest import REPO, write_profile
from tests.onnx_models import make_mlp
from tests.polling import wait_until
from tests.server import ServerProcess

runner = CliRunner()
ADMIN, ACME = "unix-admin-key", "unix-acme-key"
PROFILE = f"""
[server]
file_stable_s = 0.1
admin_keys = ["{hash_key(ADMIN)}"]
[tenants.acme]
rps = 50
burst = 60
models = ["dig[a-z]ts"]
api_keys = ["{hash_key(ACME)}"]
"""
ENV_CLEAN = {"INFERGATE_URL": "", "INFERGATE_TOKEN": "", "INFERGATE_ADMIN_TOKEN": ""}


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env={**ENV_CLEAN, **(env or {})})
    return result.exit_code, result.output


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The real command in a subprocess (its stderr, exit code, no terminal)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("INFERGATE_")}
    full_env["INFERGATE_RUNTIME_PLUGINS"] = os.environ.get("INFERGATE_RUNTIME_PLUGINS", "")
    full_env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "infergate", *args],
        capture_output=True,
        text=True,
        check=False,
        env={**full_env, **(env or {})},
        cwd=cwd,
        timeout=60,
    )


@pytest.fixture(scope="module")
def unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("unix")
    models = folder / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    shutil.copytree(REPO / "models" / "digits", models / "digits")
    proc = ServerProcess(models, write_profile(folder, PROFILE), folder / "server.log")
    yield proc.start()
    proc.stop()


def admin(server: ServerProcess, *args: str) -> tuple[int, str]:
    return run(*args, "--url", server.url, env={"INFERGATE_ADMIN_TOKEN": ADMIN})


def wait_for(check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        time.sleep(0.1)


COMMANDS = [
    ["serve"],
    ["infer"],
    ["bench"],
    ["top"],
    ["doctor"],
    *[["model", c] for c in ("list", "status", "load", "reload", "unload", "keygen", "sign")],
    ["model", "verify"],
    *[["tenant", c] for c in ("list", "add", "set", "remove")],
    *[["breaker", c] for c in ("list", "set", "reset")],
    ["key", "new"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_help_has_h_an_example_and_its_defaults(command: list[str]) -> None:
    code, out = run(*command, "-h")
    assert code == 0, out
    out = " ".join(out.split())  # Click wraps the help to the width
    assert "Example:" in out
    assert f"$ infergate {command[0]}" in out
    if command == ["serve"]:
        assert "[default: the profile's server.models, else models/" in out
        for name in ("MODELS", "PROFILE", "HOST", "PORT", "LOG_LEVEL"):  # Click's, once
            assert out.count(f"INFERGATE_{name}") == 1, out
            assert f"[env var: INFERGATE_{name}" in out
    if command == ["bench"]:
        assert "[default: 2.0]" in out
    # The examples name models the project's models/ holds (README's quick start serves it).
    named = r"infer|bench|model (?:status|load|reload|unload)|breaker (?:set|reset)"
    for name in re.findall(rf"\$ infergate (?:{named}) ([\w.-]+) ", out + " "):
        assert (REPO / "models" / name).is_dir(), name
    if command[0] in ("infer", "bench"):
        assert "-v," not in out  # -v is not the model version (it looked like --version)
        assert "--model-version" in out


def test_version_flags() -> None:
    for flag in ("--version", "-V"):
        code, out = run(flag)
        assert code == 0
        assert out.startswith("infergate ")


def test_text_is_shown_as_written(unix_server: ServerProcess, tmp_path: Path) -> None:
    code, out = admin(unix_server, "tenant", "list")
    assert code == 0, out
    assert "dig[a-z]ts" in out
    done = cli("model", "status", "[/x]", "--url", unix_server.url,
               env={"INFERGATE_ADMIN_TOKEN": ADMIN})  # fmt: skip
    assert done.returncode == 2  # not a model name (Rich would have read [/x] as a tag)
    assert done.stderr.startswith("error: '[/x]' is not a model name: ")
    assert len(done.stderr.strip().splitlines()) == 1
    odd = tmp_path / "a[b]c[red].txt"
    odd.write_text("not a model")
    done = cli("model", "verify", str(odd))
    assert done.returncode == 1
    assert f"{odd} is not a model infergate can serve" in done.stderr
    assert "Traceback" not in done.stderr


def test_tables_are_whole_off_a_terminal_and_format_tsv_json(
    unix_server: ServerProcess,
) -> None:
    done = cli("model", "list", "--url", unix_server.url, env={"INFERGATE_ADMIN_TOKEN": ADMIN})
    assert done.returncode == 0, done.stderr
    assert "onnxruntime_onnx" in done.stdout
    assert "…" not in done.stdout
    for command in (["model", "list"], ["tenant", "list"], ["breaker", "list"]):
        code, out = admin(unix_server, *command, "--format", "tsv")
        assert code == 0, out
        header, *rows = out.splitlines()
        assert "\t" in header
        assert rows
        assert all(r.count("\t") == header.count("\t") for r in rows)
        code, out = admin(unix_server, *command, "--format", "json")
        assert code == 0, out
        assert isinstance(json.loads(out), list)
    code, out = run("doctor", "--models", str(REPO / "models"), "--format", "tsv")
    assert out.splitlines()[0] == "check\tstatus\tdetail"


def test_breaker_json_gives_absent_values_as_null(unix_server: ServerProcess) -> None:
    # mlp: closed, and no request has reached it (acme's are refused before its breaker).
    code, out = admin(unix_server, "breaker", "list", "--json")
    assert code == 0, out
    mlp = next(r for r in json.loads(out) if r["model"] == "mlp")
    assert mlp["state"] == "closed"
    assert mlp["window_requests"] == 0
    assert (mlp["reason"], mlp["retry_after_s"], mlp["window_p99_ms"]) == (None, None, None)
    code, out = admin(unix_server, "breaker", "list", "--format", "tsv")
    assert code == 0, out
    rows = [line.split("\t") for line in out.splitlines()]
    assert rows[0] == [
        "model", "version", "state", "retry in", "window reqs", "failures", "p99 ms", "reason"
    ]  # fmt: skip
    assert ["mlp", "1", "closed", "-", "0", "0", "-", ""] in rows


def test_tenant_json_keeps_its_types_across_a_change(unix_server: ServerProcess) -> None:
    def acme() -> dict[str, Any]:
        code, out = admin(unix_server, "tenant", "list", "--json")
        assert code == 0, out
        return next(t for t in json.loads(out) if t["name"] == "acme")

    before = acme()
    code, out = admin(unix_server, "tenant", "set", "acme", "rps=7", "burst=9")
    assert code == 0, out
    after = acme()
    assert (after["rps"], after["burst"]) == (7.0, 9.0)
    assert {k: type(v) for k, v in before.items()} == {k: type(v) for k, v in after.items()}


def test_finding_the_server(unix_server: ServerProcess, tmp_path: Path) -> None:
    bare = unix_server.url.removeprefix("http://")
    code, out = run("model", "list", "--json", env={"INFERGATE_URL": bare,
                    "INFERGATE_ADMIN_TOKEN": ADMIN})  # fmt: skip
    assert code == 0, out
    project = tmp_path / "project"
    (project / "profiles").mkdir(parents=True)
    (project / "profiles" / "default.toml").write_text(f"[server]\nport = {unix_server.port}\n")
    done = cli("model", "list", "--json", cwd=project, env={"INFERGATE_ADMIN_TOKEN": ADMIN})
    assert done.returncode == 0, done.stderr
    assert {m["name"] for m in json.loads(done.stdout)} == {"mlp", "digits"}


def test_default_url_without_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERGATE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_url() == "http://127.0.0.1:8000"
    monkeypatch.setenv("INFERGATE_URL", "https://gw.example:9000/")
    assert default_url() == "https://gw.example:9000"


def test_a_project_profile_that_does_not_parse_is_named_when_the_server_is_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its port cannot be read, so the CLI tries 127.0.0.1:8000; if nothing answers there,
    the error says why the profile's port was not used (it said only 'is serve running?')."""
    monkeypatch.delenv("INFERGATE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert project_profile_unread() is None  # no profile: nothing to say
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "default.toml").write_text("[server]\nport = 18123\n")
    assert project_profile_unread() is None  # read: its port is the URL
    (tmp_path / "profiles" / "default.toml").write_text("[server]\nport = 18123\nbroken =\n")
    assert default_url() == "http://127.0.0.1:8000"
    unread = project_profile_unread()
    assert unread is not None
    assert unread.startswith("profiles/default.toml does not parse (")
    monkeypatch.setenv("INFERGATE_URL", "127.0.0.1:18123")
    assert project_profile_unread() is None  # the URL is the user's own choice


def test_tenant_and_admin_tokens_are_separate(unix_server: ServerProcess) -> None:
    code, out = run("model", "list", "--url", unix_server.url, env={"INFERGATE_TOKEN": ADMIN})
    assert code == 1  # the tenant token is not sent to admin commands
    assert "HTTP 401" in out
    sample = str(REPO / "examples" / "digit-7.npy")
    code, out = run("infer", "digits", sample, "--url", unix_server.url, "--json",
                    env={"INFERGATE_TOKEN": ACME, "INFERGATE_ADMIN_TOKEN": "nope"})  # fmt: skip
    assert code == 0, out
    code, out = run("infer", "mlp", "x=[[1, 2, 3, 4]]", "--url", unix_server.url,
                    env={"INFERGATE_TOKEN": ACME})  # fmt: skip
    assert code == 1
    assert "HTTP 403" in out


def test_key_new_prints_once_and_writes_the_hash(
    unix_server: ServerProcess, tmp_path: Path
) -> None:
    code, out = run("key", "new", "--tenant", "acme", "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["sha256"] == hash_key(doc["key"])
    assert doc["written_to"] is None
    code, out = run("key", "new", "--admin", "--tenant", "acme")
    assert code == 2
    code, out = run("key", "new", "--write")
    assert code == 2
    # Written into the running server's profile: the new key works at once.
    code, out = run(
        "key", "new", "--tenant", "acme", "--write", "--profile", str(unix_server.profile)
    )
    assert code == 0, out
    key = out.split("key:", 1)[1].split()[0]
    assert hash_key(key) in unix_server.profile.read_text()
    assert "acme" in unix_server.profile.read_text()

    def works() -> bool:
        r = httpx.post(
            f"{unix_server.url}/v2/models/digits/infer",
            json={"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64],
                              "data": [0.0] * 64}]},
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
        return r.status_code == 200

    wait_for(works)
    code, out = run(
        "key", "new", "--admin", "--write", "--profile", str(tmp_path / "fresh.toml"), "--json"
    )
    assert code == 0, out
    assert json.loads(out)["sha256"] in (tmp_path / "fresh.toml").read_text()


def test_key_new_says_when_it_creates_a_tenant(tmp_path: Path) -> None:
    """A tenant name that the profile lacks (a typo, or the README's `trial`) makes a new
    tenant open to every model: the command says so, in text and JSON."""
    profile = write_profile(tmp_path, PROFILE)
    code, out = run("key", "new", "--tenant", "trial", "--write", "--profile", str(profile))
    assert code == 0, out
    assert (
        f"created tenant trial (class: burst, models: *), as {profile} had no tenant of that "
        "name. Hint: a typo? Remove it with: infergate tenant remove trial"
    ) in out
    code, out = run("key", "new", "--tenant", "trial", "--write", "--profile", str(profile))
    assert code == 0, out
    assert "created" not in out
    assert (
        f"added to tenants.trial.api_keys in {profile} (existing tenant trial, now with 2 keys)"
        in out
    )
    code, out = run(
        "key", "new", "--tenant", "trail", "--write", "--profile", str(profile), "--json"
    )
    assert code == 0, out
    assert json.loads(out)["tenant"] == {
        "name": "trail", "created": True, "class": "burst", "models": ["*"], "keys": 1
    }  # fmt: skip
    code, out = run(
        "key", "new", "--tenant", "acme", "--write", "--profile", str(profile), "--json"
    )
    assert code == 0, out
    assert json.loads(out)["tenant"] == {
        "name": "acme", "created": False, "class": "burst", "models": ["dig[a-z]ts"], "keys": 2
    }  # fmt: skip
    code, out = run("key", "new", "--admin", "--write", "--profile", str(profile), "--json")
    assert code == 0, out
    assert json.loads(out)["tenant"] is None  # not left out


def test_serve_mistakes_are_one_line_and_an_exit_code(
    unix_server: ServerProcess, tmp_path: Path
) -> None:
    models = str(unix_server.models)
    cases = [
        (["--port", "99999"], 2, "port 99999 is out of range"),
        (["--port", str(unix_server.port)], 1, "Address already in use"),
        (["--log-level", "loud"], 2, "--log-level 'loud'"),
        (["--log-format", "xml"], 2, "--log-format 'xml'"),
    ]
    for args, code, words in cases:
        done = cli("serve", "--models", models, *args, cwd=tmp_path)
        assert done.returncode == code, (args, done.stderr)
        assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
        assert words in done.stderr
    done = cli("serve", "--models", models, cwd=tmp_path, env={"INFERGATE_PORT": "70000"})
    assert done.returncode == 2
    assert "port 70000 is out of range" in done.stderr


def test_serve_on_a_public_address_without_admin_keys_names_the_command_that_fixes_it(
    tmp_path: Path,
) -> None:
    """The refusal names the command to run, for the profile serve reads, in one line on
    stderr (plain text: it is said before logging starts, whatever --log-format); that
    command, run as written, lets the same serve past the check (to the next one: --port)."""
    models = tmp_path / "models"
    models.mkdir()
    bare, project = tmp_path / "bare", tmp_path / "project"
    bare.mkdir()
    (project / "profiles").mkdir(parents=True)
    (project / "other.toml").write_text("[server]\n")
    for cwd, args, fix in (
        (bare, [], "mkdir profiles && infergate key new --admin --write"),
        (project, [], "infergate key new --admin --write"),
        (
            project,
            ["--profile", "other.toml"],
            "infergate key new --admin --write --profile other.toml",
        ),
    ):
        serve = ["serve", "--models", str(models), "--host", "0.0.0.0", *args]
        done = cli(*serve, "--log-format", "json", cwd=cwd)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith("error: refusing to serve on 0.0.0.0, which is not a loopback")
        assert f"Fix: {fix} (adds an admin key's hash to " in line
        assert line.endswith("or bind 127.0.0.1")
        shell = f'infergate() {{ {shlex.quote(sys.executable)} -m infergate "$@"; }}; {fix}'
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERGATE_")}
        env["PYTHONPATH"] = str(REPO)
        fixed = subprocess.run(["bash", "-c", shell], cwd=cwd, env=env, capture_output=True)
        assert fixed.returncode == 0, fixed.stderr
        done = cli(*serve, "--port", "99999", cwd=cwd)
        assert "port 99999 is out of range" in done.stderr


def test_port_0_serves_on_a_free_port_that_the_listening_line_names(
    unix_server: ServerProcess, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERGATE_")}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "infergate", "serve", "--models", str(unix_server.models)]
            + ["--port", "0"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**env, "PYTHONPATH": str(REPO)},
            cwd=tmp_path,
        )
    try:
        found = wait_until(
            lambda: re.search(rb"listening on (http://127\.0\.0\.1:(\d+))", log.read_bytes()),
            timeout_s=60,
            what="the listening line",
        )
        assert int(found.group(2)) > 0
        assert httpx.get(found.group(1).decode() + "/v2/health/live", timeout=10).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_model_verify_on_a_non_model_exits_1(tmp_path: Path) -> None:
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"not a model at all")
    # In-process: the real command's stderr for a file that is not a model is
    # test_text_is_shown_as_written's (a process costs half a second of CPU).
    code, out = run("model", "verify", str(fake))
    assert code == 1
    assert "is not a model infergate can serve" in out
    assert "Traceback" not in out
    code, out = run("model", "verify", str(fake), "--json")
    assert code == 1
    assert json.loads(out)["opens"] == "no"


def test_model_list_shows_a_failed_new_version_and_a_refused_model_toml(
    unix_server: ServerProcess,
) -> None:
    broken = unix_server.models / "mlp" / "2" / "model.onnx"
    broken.parent.mkdir()
    broken.write_bytes(b"garbage, not onnx")
    toml = unix_server.models / "digits" / "model.toml"
    toml.write_text("instances = 'many'\n")
    try:

        def listed() -> dict[str, Any]:
            code, out = admin(unix_server, "model", "list", "--json")
            assert code == 0, out
            return {m["name"]: m for m in json.loads(out)}

        wait_for(lambda: "2" in listed()["mlp"]["failures"] and listed()["digits"]["reason"])
        models = listed()
        code, out = admin(unix_server, "model", "list", "--format", "tsv")
        rows = [line.split("\t") for line in out.splitlines()[1:]]
        mlp = {r[1]: r for r in rows if r[0] == "mlp"}
        assert mlp["1*"][2] == "ready"  # the old version keeps serving
        assert mlp["2"][2] == "failed"
        assert mlp["2"][5] == models["mlp"]["failures"]["2"]
        digits = [r for r in rows if r[0] == "digits"]
        refused = [r for r in digits if r[5] == models["digits"]["reason"]]
        assert len(refused) == 1
        assert "instances" in refused[0][5]
        assert refused[0][2] == "refused"  # the edit's row, not "ready" beside its reason
    finally:
        toml.unlink()
        shutil.rmtree(broken.parent)


def test_usage_mistakes_are_one_line_and_exit_2() -> None:
    for args, words in (
        (["bench", "digits", "--concurrency-range", "many"], "--concurrency-range"),
        (["model", "list", "--bogus"], "No such option: --bogus"),
        (["serve", "--port", "abc"], "--port"),
    ):
        done = cli(*args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert words in done.stderr
        assert f"Hint: infergate {args[0]}" in done.stderr
    # Click's own stop is kept, not doubled, and pydantic's "Value error, " is dropped.
    for args, line in (
        (["settings"], "error: No such command 'settings'. Hint: infergate -h"),
        (
            ["model", "lst"],
            "error: No such command 'lst'. Did you mean 'list'? Hint: infergate model -h",
        ),
        (
            ["model", "list", "--format", "xml"],
            "error: Invalid value for '--format': 'xml' is not one of 'table', 'tsv', 'json'. "
            "Hint: infergate model list -h",
        ),
    ):
        done = cli(*args)
        assert (done.returncode, done.stderr) == (2, line + "\n")


def test_models_naming_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """`--models model.onnx` (a file where the repository folder goes) says so, in one
    line and exit 2, in each command that takes --models: not a folder that "does not
    exist", which sent people looking for a missing path."""
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"weights")
    said = (
        f"--models {onnx} is a file, not a folder: --models wants the model repository "
        "folder (one folder per model)"
    )
    for args, env in (
        (["doctor", "--models", str(onnx)], None),
        (["serve", "--models", str(onnx)], None),
        (["serve"], {"INFERGATE_MODELS": str(onnx)}),
    ):
        done = cli(*args, env=env, cwd=tmp_path)
        assert (done.returncode, done.stderr, done.stdout) == (2, f"error: {said}\n", ""), args
    done = cli("doctor", "--models", str(onnx), "--json", cwd=tmp_path)
    assert (done.returncode, json.loads(done.stdout), done.stderr) == (2, {"error": said}, "")
    profile = write_profile(tmp_path, f'[server]\nmodels = "{onnx}"\n')
    done = cli("serve", "--profile", str(profile), cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        f"error: server.models {onnx} is a file, not a folder: server.models wants the "
        "model repository folder (one folder per model)\n",
    )
