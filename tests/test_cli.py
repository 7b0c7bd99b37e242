"""The CLI against a real server: people's tables, --json for scripts, exit codes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from infergate.cli.main import app
from tests.server import ServerProcess, free_port

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def run(*args: str, stdin: str | None = None) -> tuple[int, str]:
    result = runner.invoke(app, list(args), input=stdin)
    return result.exit_code, result.output


def test_model_list_json_and_table(server: ServerProcess) -> None:
    code, out = run("model", "list", "--url", server.url, "--json")
    assert code == 0
    models = {m["name"]: m for m in json.loads(out)}
    assert models["digits"]["state"] == "ready"
    assert models["broken"]["state"] == "failed"
    assert [v["version"] for v in models["mlp"]["versions"]] == [1, 2]
    code, out = run("model", "list", "--url", server.url)
    assert code == 0
    assert "digits" in out
    assert "onnxruntime_onnx" in out


def test_model_status_shows_instances(server: ServerProcess) -> None:
    code, out = run("model", "status", "digits", "--url", server.url, "--json")
    assert code == 0
    status = json.loads(out)
    [instance] = status["versions"][0]["instances"]
    assert instance["pid"] in server.worker_pids("digits")
    assert instance["device"] == "cpu"
    code, out = run("model", "status", "digits", "--url", server.url)
    assert code == 0
    assert str(instance["pid"]) in out
    assert "probabilities" in out


def test_infer_npy_sample_predicts_its_digit(server: ServerProcess) -> None:
    code, out = run(
        "infer", "digits", str(REPO / "examples" / "digit-7.npy"), "--url", server.url, "--json"
    )
    assert code == 0, out
    outputs = {o["name"]: o for o in json.loads(out)["outputs"]}
    assert outputs["label"]["data"] == [7]
    code, out = run(
        "infer", "digits", f"input={REPO / 'examples' / 'digit-7.npy'}", "--url", server.url
    )
    assert code == 0
    assert "label" in out
    assert "[7]" in out


def test_infer_json_literal_save_and_json_transport(server: ServerProcess, tmp_path: Path) -> None:
    code, out = run(
        "infer",
        "mlp",
        "x=[[1, 2, 3, 4]]",
        "--model-version",
        "1",
        "--no-binary",
        "--save",
        str(tmp_path),
        "--url",
        server.url,
    )
    assert code == 0, out
    saved = np.load(tmp_path / "y.npy")
    assert saved.shape == (1, 3)
    assert f"saved y.npy to {tmp_path}\n" in out  # the files written, by name
    code, out = run(
        "infer", "digits", str(REPO / "examples" / "digit-7.npy"),
        "--save", str(tmp_path / "digits"), "--url", server.url, "--json",
    )  # fmt: skip
    assert code == 0, out
    paths = json.loads(out)["saved"]
    assert sorted(paths) == [
        str(tmp_path / "digits" / f"{n}.npy") for n in ("label", "probabilities")
    ]
    assert np.load(paths[0]).size >= 1


def test_infer_reads_a_v2_request_on_stdin(server: ServerProcess) -> None:
    request = {
        "id": "from-stdin",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
    }
    code, out = run("infer", "mlp", "-", "--url", server.url, "--json", stdin=json.dumps(request))
    assert code == 0, out
    doc = json.loads(out)
    assert doc["id"] == "from-stdin"
    assert doc["outputs"][0]["shape"] == [1, 3]


STDIN_OUTPUT_LINE = (
    "-o/--output does not apply to a request on stdin, which names its own outputs: drop -o, "
    'or put "outputs" in the request'
)


def test_infer_output_with_a_request_on_stdin_is_a_usage_error(server: ServerProcess) -> None:
    """`infer MODEL - -o NAME` ignored -o and answered every output: the request on stdin
    is sent as it is, so it is the one to name the outputs."""
    data = np.load(REPO / "examples" / "digit-7.npy").reshape(-1).tolist()
    request: dict[str, Any] = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": data}]
    }
    for extra, stdout in (([], ""), (["--json"], json.dumps({"error": STDIN_OUTPUT_LINE}))):
        result = runner.invoke(
            app,
            ["infer", "digits", "-", "-o", "label", "--url", server.url, *extra],
            input=json.dumps(request),
        )
        assert result.exit_code == 2, result.output
        if extra:
            assert (json.loads(result.stdout), result.stderr) == (json.loads(stdout), "")
        else:
            assert (result.stdout, result.stderr) == ("", f"error: {STDIN_OUTPUT_LINE}\n")
    # What the line says to do instead
    request["outputs"] = [{"name": "label"}]
    code, out = run(
        "infer", "digits", "-", "--url", server.url, "--json", stdin=json.dumps(request)
    )
    assert code == 0, out
    assert [(o["name"], o["data"]) for o in json.loads(out)["outputs"]] == [("label", [7])]


@pytest.mark.parametrize("flag", ["--binary", "--no-binary"])
def test_infer_binary_with_a_request_on_stdin_is_a_usage_error(
    server: ServerProcess, flag: str
) -> None:
    """`infer MODEL - --no-binary` was silently ignored: the request on stdin is sent as
    it is, so a flag about how to send tensors says so and does nothing."""
    request = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    result = runner.invoke(
        app, ["infer", "mlp", "-", flag, "--url", server.url], input=json.dumps(request)
    )
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        "error: --binary/--no-binary does not apply to a request on stdin, which is sent as "
        "it is: drop the flag, or give the inputs as NAME=FILE\n"
    )
    code, out = run("infer", "mlp", "x=[[1,2,3,4]]", flag, "--url", server.url, "--json")
    assert code == 0, out  # with inputs given, either way works
    assert json.loads(out)["outputs"][0]["shape"] == [1, 3]


def test_key_new_write_keeps_the_profiles_mode_and_leaves_nothing_beside(
    tmp_path: Path,
) -> None:
    """The profile holds admin key hashes: one kept private (0600) stays so once a key is
    added (its new copy took the umask's 0644), and no temporary file is left beside it."""
    profile = tmp_path / "profile.toml"
    profile.write_text("[server]\nport = 8123\n")
    profile.chmod(0o600)
    code, out = run("key", "new", "--admin", "--write", "--profile", str(profile), "--json")
    assert code == 0, out
    assert profile.stat().st_mode & 0o777 == 0o600
    assert "port = 8123" in profile.read_text()
    assert json.loads(out)["sha256"] in profile.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["profile.toml"]


def test_infer_without_inputs_says_how_to_give_them() -> None:
    """It said only "give the inputs (NAME=FILE.npy ...)": now the forms, the one-input
    shortcut and where the model's input names are, checked before any request."""
    result = runner.invoke(app, ["infer", "digits", "--url", "127.0.0.1:9"])
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        "error: give the inputs: NAME=FILE.npy or NAME='[[1, 2]]' each (FILE.npy alone for "
        "a one-input model; infergate model status digits names them), or - to read a V2 "
        "request on stdin\n"
    )


def test_infer_help_examples_run_as_written(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`infer -h`'s examples, run from the project folder, against the example `digits`."""
    monkeypatch.chdir(REPO)
    code, out = run("infer", "-h")
    assert code == 0, out
    examples = [
        shlex.split(line.split("$ infergate ")[1]) for line in out.splitlines() if "$ " in line
    ]
    assert len(examples) == 2, out
    for args in examples:
        code, out = run(*args, "--url", server.url)
        assert code == 0, (args, out)
        assert "label" in out


def test_failures_and_usage_have_exit_codes(server: ServerProcess) -> None:
    code, out = run("infer", "nope", "x=[1]", "--url", server.url, "--json")
    assert code == 1
    assert "unknown model: 'nope'" in json.loads(out)["error"]
    code, out = run("infer", "mlp", "x=[[1, 2, 3]]", "--url", server.url)
    assert code == 1
    assert "expects [-1, 4]" in out
    assert "HTTP 400" in out
    code, _ = run("infer", "mlp", "--url", server.url)
    assert code == 2
    code, out = run("model", "list", "--url", f"http://127.0.0.1:{free_port()}")
    assert code == 1
    assert "cannot reach infergate" in out


def test_doctor(tmp_path: Path) -> None:
    code, out = run("doctor", "--models", str(REPO / "models"), "--json")
    assert code == 0, out
    checks = {c["name"]: c for c in json.loads(out)}
    assert checks["onnxruntime"]["status"] == "ok"
    assert "CPUExecutionProvider" in checks["onnxruntime"]["detail"]
    assert checks["torch"]["status"] == "ok"
    assert "CPU only" in checks["torch"]["detail"]  # this machine's torch is a CPU build
    assert checks["model digits"]["status"] == "ok"
    assert checks["model encoder"]["status"] == "ok"
    assert checks["device backend"]["detail"].startswith("host")
    assert "GiB used" in checks["device cpu"]["detail"]
    code, out = run("doctor", "--models", str(tmp_path / "missing"), "--json")
    assert code == 1
    assert "does not exist" in {c["name"]: c for c in json.loads(out)}["models"]["detail"]


def test_doctor_applies_the_profile_s_signature_rule(tmp_path: Path) -> None:
    """With require_signed_models, an unsigned model showed "ok" in doctor (exit 0) while
    the server refused it: doctor reads the profile serve reads and applies its rule."""
    from infergate.engine.repository.verify import generate_key, load_private_key, sign_file
    from tests.onnx_models import make_echo

    public = generate_key(tmp_path / "team.key")
    models = tmp_path / "models"
    sign_file(
        make_echo(models / "signed" / "1" / "model.onnx"), load_private_key(tmp_path / "team.key")
    )
    make_echo(models / "unsigned" / "1" / "model.onnx")
    profile = tmp_path / "profile.toml"
    profile.write_text(
        f"[server]\nrequire_signed_models = true\ntrusted_keys = [{str(public)!r}]\n"
    )
    code, out = run("doctor", "--models", str(models), "--profile", str(profile), "--json")
    assert code == 1, out
    checks = {c["name"]: c for c in json.loads(out)}
    assert checks["model signed"]["status"] == "ok"
    assert checks["model unsigned"]["status"] == "fail"
    assert "version 1:" in checks["model unsigned"]["detail"]
    assert "not signed" in checks["model unsigned"]["detail"]


def test_doctor_without_torch_says_to_install_it_into_the_venv_then_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bare `pip install` goes to whatever environment is first on PATH: the hint names
    install.sh or the project's own pip, and the load that picks the runtime up."""
    import importlib.metadata

    installed = importlib.metadata.version

    def version(package: str) -> str:
        if package == "torch":
            raise importlib.metadata.PackageNotFoundError(package)
        return installed(package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    code, out = run("doctor", "--models", str(REPO / "models"), "--json")
    assert code == 0, out
    assert {c["name"]: c for c in json.loads(out)}["torch"] == {
        "name": "torch",
        "status": "warn",
        "detail": "not installed: TorchScript models are unavailable. Hint: ./install.sh "
        "--torch (on a machine without a GPU: PIP_EXTRA_INDEX_URL="
        "https://download.pytorch.org/whl/cpu ./install.sh --torch, for torch's CPU build "
        "instead of PyPI's CUDA one of several GB), then infergate model load NAME",
    }


@pytest.mark.parametrize(
    ("version_py", "cpu_build"),
    [
        ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", True),
        ("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", False),
        ("cuda = None\nhip = '6.2'\n", False),  # ROCm builds answer through torch.cuda
        ("__version__ = '9.9'\n", False),  # no cuda line: ask torch itself
        ("cuda = (\n", False),  # unreadable: ask torch itself
    ],
)
def test_doctor_knows_a_cpu_torch_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version_py: str, cpu_build: bool
) -> None:
    """`infergate doctor` reads torch's build from torch/version.py (importing torch costs
    about 2 s of CPU); only a build with CUDA or ROCm is imported to count its devices."""
    from infergate.cli import doctor

    package = tmp_path / "torch"
    package.mkdir()
    (package / "version.py").write_text(version_py)
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    assert doctor._torch_is_cpu_build() is cpu_build


def test_python_dash_m_and_bad_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "infergate", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0
    assert done.stdout.startswith("infergate ")
    done = subprocess.run(
        [sys.executable, "-m", "infergate", "model", "list", "--bogus"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2


def test_serve_refuses_a_missing_models_folder(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "infergate",
            "serve",
            "--models",
            str(tmp_path / "none"),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr


def test_bench_sweeps_concurrency_and_rate(server: ServerProcess) -> None:
    code, out = run(
        "bench", "digits", "--concurrency", "1,4", "--duration", "0.5", "--windows", "1",
        "--url", server.url, "--json",
    )  # fmt: skip
    assert code == 0, out
    levels = json.loads(out)["levels"]
    assert [r["level"] for r in levels] == [1, 4]
    assert all(r["ok"] > 5 and r["failures"] == [] for r in levels)
    code, out = run(
        "bench", "mlp", "--rate", "40", "--duration", "0.5", "--windows", "1", "--batch", "3",
        "--no-binary", "--priority", "batch", "--url", server.url, "--json",
    )  # fmt: skip
    assert code == 0, out
    [result] = json.loads(out)["levels"]
    assert result["mode"] == "rate"
    assert 15 <= result["requests"] <= 21  # 40/s over a 0.5 s window
    code, out = run("bench", "digits", "--duration", "0.3", "--windows", "1", "--url", server.url)
    assert code == 0
    assert "req/s" in out
    assert "p99 ms" in out
    code, out = run("bench", "digits", "--concurrency", "many", "--url", server.url)
    assert code == 2


def test_model_list_says_each_failure_once_on_the_version_it_belongs_to() -> None:
    """A failed new version beside the one serving, two versions failing alike, and a
    version whose runtime is missing: a row each, the failure on its own version's row
    (the model-wide reason, "version N: ..." and what keeps serving, repeats a row
    already shown, so it gets none)."""
    from infergate.cli.model import model_rows

    def version(number: int, state: str, reason: str | None) -> dict[str, object]:
        return {
            "version": number,
            "state": state,
            "instances": [],
            "platform": "onnx",
            "reason": reason,
        }

    bad = "load failed: InvalidProtobuf"
    missing = "the torchscript runtime needs torch"
    models: list[dict[str, Any]] = [
        {
            "name": "digits",
            "state": "ready",
            "default_version": 1,
            "reason": f"version 2: {bad}; version 1 keeps serving",  # the registry's words
            "versions": [version(1, "ready", None)],
            "failures": {"2": bad},
        },
        {
            "name": "twice",
            "state": "failed",
            "default_version": None,
            "reason": f"version 2: {missing}",
            "versions": [],
            "failures": {"1": missing, "2": missing},
        },
        {
            "name": "encoder",
            "state": "unavailable",
            "default_version": 1,
            "reason": f"version 1: {missing}",
            "versions": [version(1, "unavailable", missing)],
            "failures": {"1": missing},
        },
        {  # a model.toml edit refused: the row says refused, not "ready" beside its reason
            "name": "edited",
            "state": "ready",
            "default_version": 1,
            "reason": "model.toml: bad value; version 1 keeps serving",
            "versions": [version(1, "ready", None)],
            "failures": {},
        },
    ]
    rows = [[str(cell) for cell in row] for row in model_rows(models)]
    assert [(r[0], r[1], r[2], r[5]) for r in rows] == [
        ("digits", "1*", "ready", ""),
        ("digits", "2", "failed", bad),
        ("twice", "1", "failed", missing),  # two versions failing alike: a row each
        ("twice", "2", "failed", missing),
        ("encoder", "1*", "unavailable", missing),
        ("edited", "1*", "ready", ""),
        ("edited", "-", "refused", "model.toml: bad value; version 1 keeps serving"),
    ]
