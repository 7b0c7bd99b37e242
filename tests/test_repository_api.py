"""Triton's repository extension with tritonclient, explicit model control, and signed
models, each against a real server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from infergate.engine.repository.verify import generate_key, load_private_key, sign_file
from tests.conftest import write_profile
from tests.onnx_models import make_mlp
from tests.polling import wait_until
from tests.server import ServerProcess
from tests.test_reload import failures, infer, offset_of, place


def start(tmp_path: Path, profile: str) -> ServerProcess:
    return ServerProcess(
        tmp_path / "models", write_profile(tmp_path, profile), tmp_path / "server.log"
    ).start()


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the file's explicit-mode tests. It loads `present` at start; each
    test adds models of its own and loads them (nothing else would), so none sees
    another's."""
    root = tmp_path_factory.mktemp("explicit")
    make_mlp(root / "models" / "present" / "1" / "model.onnx")
    proc = start(root, '[server]\nmodel_control = "explicit"\nfile_stable_s = 0.1\n')
    yield proc
    proc.stop()


def add(server: ServerProcess, name: str, seed: int = 0) -> str:
    make_mlp(server.models / name / "1" / "model.onnx", seed=seed)
    triton.InferenceServerClient(server.url.removeprefix("http://")).load_model(name)
    return name


def test_tritonclient_load_unload_index(explicit_server: ServerProcess) -> None:
    client = triton.InferenceServerClient(explicit_server.url.removeprefix("http://"))
    spare = add(explicit_server, "spare-index", seed=2)
    pids = explicit_server.worker_pids(spare)
    client.unload_model(spare)
    for pid in pids:
        assert not psutil.pid_exists(pid)  # unload returns after the workers exited
    assert not client.is_model_ready(spare)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index[spare]["state"] == "UNAVAILABLE"
    assert "unloaded" in index[spare]["reason"]
    assert index["present"]["state"] == "READY"  # loaded at start
    client.load_model(spare)
    assert client.is_model_ready(spare)
    # The models that are there are named (a typo's error said only what was not), those
    # on disk and not loaded too (explicit mode loads none by itself).
    make_mlp(explicit_server.models / "on-disk" / "1" / "model.onnx")
    there = r"no model 'nothere' in .*; models there: .*on-disk, .*present, .*spare-index"
    with pytest.raises(InferenceServerException, match=there):
        client.load_model("nothere")


def test_explicit_mode_ignores_file_changes_until_load(explicit_server: ServerProcess) -> None:
    name = add(explicit_server, "edited")
    make_mlp(explicit_server.models / "unasked" / "1" / "model.onnx")
    base = infer(explicit_server.url, name).json()["outputs"][0]["data"]
    place(explicit_server.models / name / "1" / "model.onnx", lambda p: make_mlp(p, offset=3.0))
    # No watcher in explicit mode: give a watcher ample time, and the old file still serves
    # (and a new model folder is not loaded).
    deadline = __import__("time").monotonic() + 1.0
    while __import__("time").monotonic() < deadline:
        assert offset_of(infer(explicit_server.url, name), base) == 0
    assert infer(explicit_server.url, "unasked").status_code == 404
    client = triton.InferenceServerClient(explicit_server.url.removeprefix("http://"))
    client.load_model(name)  # loading a loaded model reloads it
    assert offset_of(infer(explicit_server.url, name), base) == 3


def test_loading_a_bad_file_says_why_and_keeps_serving(explicit_server: ServerProcess) -> None:
    name = add(explicit_server, "spoiled")
    base = infer(explicit_server.url, name).json()["outputs"][0]["data"]
    place(
        explicit_server.models / name / "1" / "model.onnx",
        lambda p: p.write_bytes(b"garbage") or p,
    )
    client = triton.InferenceServerClient(explicit_server.url.removeprefix("http://"))
    with pytest.raises(InferenceServerException, match=f"failed to load '{name}'"):
        client.load_model(name)
    assert offset_of(infer(explicit_server.url, name), base) == 0


def test_signed_models_only(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    trusted = generate_key(keys / "team.key")
    generate_key(keys / "intruder.key")
    model = tmp_path / "models" / "mlp" / "1" / "model.onnx"
    make_mlp(model)
    sign_file(model, load_private_key(keys / "team.key"))
    make_mlp(tmp_path / "models" / "unsigned" / "1" / "model.onnx")
    server = start(
        tmp_path,
        f"[server]\nrequire_signed_models = true\nfile_stable_s = 0.2\n"
        f'trusted_keys = ["{trusted}"]\n',
    )
    try:
        assert server.model("mlp")["state"] == "ready"
        unsigned = server.model("unsigned")
        assert unsigned["state"] == "failed"
        assert "is not signed" in unsigned["reason"]
        base = infer(server.url).json()["outputs"][0]["data"]

        def signed_by(key: str, offset: float) -> None:
            staged = tmp_path / "staged.onnx"
            make_mlp(staged, offset=offset)
            sign_file(staged, load_private_key(keys / key))
            (tmp_path / "staged.onnx.sig").replace(model.with_name("model.onnx.sig"))
            staged.replace(model)

        signed_by("intruder.key", 5.0)
        reason = wait_until(lambda: failures(server).get("1"), what="the rejection")
        assert "does not verify against any trusted key" in reason
        assert offset_of(infer(server.url), base) == 0
        signed_by("team.key", 6.0)
        wait_until(lambda: offset_of(infer(server.url), base) == 6, what="the signed file")
    finally:
        server.stop()


def test_cli_load_unload_reload(explicit_server: ServerProcess) -> None:
    import json

    from tests.test_cli import run

    spare = add(explicit_server, "spare-cli", seed=2)
    pids = explicit_server.worker_pids(spare)
    code, out = run("model", "unload", spare, "--url", explicit_server.url)
    assert code == 0, out
    assert f"{spare}: unloaded" in out
    assert not any(psutil.pid_exists(p) for p in pids)
    code, out = run("model", "load", spare, "--url", explicit_server.url, "--json")
    assert code == 0, out
    assert json.loads(out)["state"] == "ready"
    code, out = run("model", "reload", spare, "--url", explicit_server.url)
    assert code == 0
    assert f"{spare}: reloaded, version 1 serving" in out
    place(
        explicit_server.models / spare / "1" / "model.onnx", lambda p: p.write_bytes(b"junk") or p
    )
    code, out = run("model", "reload", spare, "--url", explicit_server.url)
    assert code == 1
    assert f"failed to load '{spare}'" in out
    assert "version 1 keeps serving" in out


def test_cli_keygen_sign_verify(tmp_path: Path) -> None:
    import json

    from tests.test_cli import run

    model = make_mlp(tmp_path / "model.onnx")
    code, out = run("model", "keygen", str(tmp_path / "k"), "--json")
    assert code == 0
    assert json.loads(out)["public_key"].endswith("k.pub")
    code, out = run("model", "keygen", str(tmp_path / "k"))
    assert code == 2
    assert "already exists" in out
    code, out = run("model", "verify", str(model), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["signature"] == "none"
    assert report["opens"] == "yes"
    assert report["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    code, out = run("model", "verify", str(model), "--key", str(tmp_path / "k.pub"))
    assert code == 1  # a key given, no signature: says so, not the server's profile setting
    assert "is not signed: " in out
    assert "the profile requires" not in out
    code, out = run("model", "sign", str(model), "--key", str(tmp_path / "k"))
    assert code == 0
    code, out = run("model", "verify", str(model), "--key", str(tmp_path / "k.pub"), "--json")
    assert code == 0
    assert json.loads(out)["signature"] == "verified"
    model.write_bytes(model.read_bytes() + b"\0")
    code, out = run("model", "verify", str(model), "--key", str(tmp_path / "k.pub"))
    assert code == 1
    assert "does not verify" in out
    # A remote model's model.toml is signed and verified as a model file; its upstreams
    # serve it, so there is nothing here to open.
    remote = tmp_path / "remote" / "model.toml"
    remote.parent.mkdir()
    remote.write_text('runtime = "remote"\n[remote]\nendpoints = ["http://127.0.0.1:1"]\n')
    assert run("model", "sign", str(remote), "--key", str(tmp_path / "k"))[0] == 0
    code, out = run("model", "verify", str(remote), "--key", str(tmp_path / "k.pub"), "--json")
    assert code == 0, out
    assert json.loads(out)["signature"] == "verified"
    assert json.loads(out)["opens"].startswith("not checked (a remote model")
    (tmp_path / "bad.onnx").write_bytes(b"nope")
    code, out = run("model", "verify", str(tmp_path / "bad.onnx"), "--json")
    assert code == 1
    assert json.loads(out)["opens"] == "no"
