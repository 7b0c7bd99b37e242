"""The watcher never dies: a real server watching a real folder through symlink loops,
a deleted and recreated models folder, and a watch that cannot be set up; and it sees
every later edit of a model however its folder arrived (built in a hidden folder and
renamed into place, made with mkdir -p, copied with cp -r, moved in from elsewhere)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import write_profile
from tests.polling import wait_until
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the file: a test that deletes its models folder waits until the
    server has seen that, and each adds models of its own names."""
    root = tmp_path_factory.mktemp("watcher")
    models = root / "models"
    make_scripted(models / "first" / "1" / "model.scripted", controls=())
    profile = write_profile(root, "[server]\nfile_stable_s = 0.1\n")
    proc = ServerProcess(models, profile, root / "server.log")
    yield proc.start()
    proc.stop()


def no_models(server: ServerProcess, client: httpx.Client | None = None) -> bool:
    get = client.get if client is not None else httpx.get
    return bool(get(f"{server.url}/admin/models", timeout=30).json() == [])


def serves(server: ServerProcess, name: str, client: httpx.Client | None = None) -> bool:
    body = scripted_inputs(rows=1)
    post = client.post if client is not None else httpx.post
    return post(f"{server.url}/v2/models/{name}/infer", json=body, timeout=30).status_code == 200


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_a_symlink_loop_is_skipped_and_later_models_still_load(server: ServerProcess) -> None:
    loopy = server.models / "loopy" / "1"
    loopy.mkdir(parents=True)
    os.symlink("model.scripted", loopy / "model.scripted")  # points at itself: ELOOP
    os.symlink(".", loopy / "again")  # a directory loop
    # The watcher looks at it, says so and goes on (before, that ended the watcher).
    wait_for(lambda: "cannot look at" in server.log.read_text(), "the watcher to skip it")
    make_scripted(server.models / "later" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "later"), "the later model to serve")


def test_a_deleted_and_recreated_models_folder_is_watched_again(server: ServerProcess) -> None:
    assert not no_models(server)
    shutil.rmtree(server.models)
    wait_for(lambda: no_models(server), "the models to go")
    make_scripted(server.models / "second" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "second"), "a model in the new folder to serve")
    make_scripted(server.models / "third" / "1" / "model.scripted", controls=())
    wait_for(lambda: serves(server, "third"), "a model added after that to serve")


def test_a_watch_that_cannot_be_set_up_is_an_event_and_a_metric(server: ServerProcess) -> None:
    assert server.process is not None
    pid = server.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    with httpx.Client(timeout=30) as client:  # connected before the limit
        metrics = client.get(f"{server.url}/metrics").text
        assert "infergate_repository_watching 1.0" in metrics
        failed_before = watch_failures(metrics)
        with client.stream("GET", f"{server.url}/admin/events") as events:
            next(events.iter_lines())  # what streaming imports, imported while fds remain
        shutil.rmtree(server.models)
        wait_for(lambda: no_models(server, client), "the models to go")
        # Far below what is open: whatever closes meanwhile, no new fd for a watch.
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (8, hard))
        try:
            server.models.mkdir()  # a new folder, and no fd to watch it with
            with client.stream("GET", f"{server.url}/admin/events?replay=100") as events:
                for line in events.iter_lines():
                    if line.startswith("data:") and "watcher_failed" in line:
                        assert "cannot watch" in json.loads(line[5:])["message"]
                        break
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        # (Read after: /metrics opens /proc files.)
        metrics = client.get(f"{server.url}/metrics").text
        assert watch_failures(metrics) - failed_before == 3
        make_scripted(server.models / "back" / "1" / "model.scripted", controls=())
        wait_for(lambda: serves(server, "back", client), "watching to resume")


def watch_failures(metrics: str) -> float:
    name = "infergate_repository_watch_failures_total "
    (line,) = [x for x in metrics.splitlines() if x.startswith(name)]
    return float(line.removeprefix(name))


def test_doctor_says_whether_the_folder_can_be_watched(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "infergate", "doctor", "--models", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["watching"]["status"] == "ok", checks["watching"]
    assert str(tmp_path) in checks["watching"]["detail"]


def inotify_watched_inodes(pid: int) -> set[int]:
    """The inodes process `pid` has inotify watches on (Linux's /proc/PID/fdinfo)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) != "anon_inode:inotify":
                continue
            info = (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text()
        except OSError:  # closed meanwhile
            continue
        for line in info.splitlines():
            fields = dict(f.split(":", 1) for f in line.split() if ":" in f)
            if line.startswith("inotify") and "ino" in fields:
                inodes.add(int(fields["ino"], 16))
    return inodes


def serving_sha(server: ServerProcess, name: str) -> str | None:
    response = httpx.get(f"{server.url}/admin/models/{name}", timeout=30)
    if response.status_code != 200:
        return None
    model = response.json()
    shas = [v["sha256"] for v in model["versions"] if v["version"] == model["default_version"]]
    return shas[0] if shas and model["state"] == "ready" else None


def sha_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def deploy_hidden_then_rename(server: ServerProcess, name: str, tmp_path: Path) -> None:
    """The atomic deploy: build in a hidden folder inside the models folder, rename it into
    place. The race is made certain: the gateway watches the hidden folder already (so it
    follows what is made in it by events, not by a walk), and it is busy with a big folder
    moved in just before version 1 is made and the folder renamed, so it meets version 1's
    creation only after the rename."""
    assert server.process is not None
    pid = server.process.pid
    model = make_scripted(tmp_path / "model.scripted", controls=()).read_bytes()
    big = tmp_path / "big"
    for i in range(2000):  # 2000 folders for the gateway to walk and watch
        (big / str(i)).mkdir(parents=True)
    staging = server.models / f".staging-{name}"
    staging.mkdir()
    inode = staging.stat().st_ino
    wait_until(lambda: inode in inotify_watched_inodes(pid), what="a watch on the hidden folder")
    big.rename(server.models / f".big-{name}")  # one call here; thousands in the gateway
    (staging / "1").mkdir()
    (staging / "1" / "model.scripted").write_bytes(model)
    staging.rename(server.models / name)


def deploy_mkdir_p(server: ServerProcess, name: str, tmp_path: Path) -> None:
    make_scripted(server.models / name / "1" / "model.scripted", controls=())


def deploy_copy_tree(server: ServerProcess, name: str, tmp_path: Path) -> None:
    make_scripted(tmp_path / "prepared" / "1" / "model.scripted", controls=())
    shutil.copytree(tmp_path / "prepared", server.models / name)


def deploy_rename_from_outside(server: ServerProcess, name: str, tmp_path: Path) -> None:
    # tmp_path is on the same filesystem as the models folder (both under pytest's base),
    # so this is a rename, as `mv` does it.
    make_scripted(tmp_path / "prepared" / "1" / "model.scripted", controls=())
    (tmp_path / "prepared").rename(server.models / name)


@pytest.mark.parametrize(
    "deploy",
    [deploy_hidden_then_rename, deploy_mkdir_p, deploy_copy_tree, deploy_rename_from_outside],
)
def test_a_deployed_model_reloads_when_its_file_is_replaced_later(
    server: ServerProcess, deploy: Any, tmp_path: Path
) -> None:
    name = deploy.__name__.removeprefix("deploy_").replace("_", "-")
    deploy(server, name, tmp_path)
    model_file = server.models / name / "1" / "model.scripted"
    first = wait_until(lambda: serving_sha(server, name), 60, f"{name} to serve")
    assert first == sha_of(model_file)
    # Replaced in place, as an editor or `cp new.scripted 1/model.scripted` does.
    make_scripted(model_file, controls=(), width=8)
    second = sha_of(model_file)
    # A missed change never reloads: this wait is a bound on a reload that takes well
    # under a second (file_stable_s is 0.1 s), not a delay.
    wait_until(
        lambda: serving_sha(server, name) == second, 30, f"{name} to reload the replaced file"
    )
    shutil.rmtree(server.models / f".big-{name}", ignore_errors=True)


def swap_link(link: Path, target: str) -> None:
    """Point `link` at `target` atomically, as Kubernetes swaps a mounted volume's `..data`:
    a new link beside it, renamed over it."""
    fresh = link.with_name(f".{link.name}.new")
    os.symlink(target, fresh)
    os.replace(fresh, link)


def test_a_model_file_linked_from_outside_reloads_when_its_target_changes(
    server: ServerProcess, tmp_path: Path
) -> None:
    """The model's file is a symlink through a swapped link outside the models folder (a
    mounted volume's layout): nothing in the models folder changes, yet the model reloads."""
    store = tmp_path / "store"
    make_scripted(store / "a" / "model.scripted", controls=())
    make_scripted(store / "b" / "model.scripted", controls=(), width=8)
    os.symlink("a", store / "current")
    version = server.models / "mounted" / "1"
    version.mkdir(parents=True)
    os.symlink(store / "current" / "model.scripted", version / "model.scripted")
    first = wait_until(lambda: serving_sha(server, "mounted"), 60, "the linked model to serve")
    assert first == sha_of(store / "a" / "model.scripted")
    swap_link(store / "current", "b")
    second = sha_of(store / "b" / "model.scripted")
    # A missed change never reloads: a bound on a reload that takes about a second.
    wait_until(
        lambda: serving_sha(server, "mounted") == second, 30, "the model to reload the new target"
    )


def test_a_model_folder_linked_from_outside_reloads_when_its_file_is_replaced(
    server: ServerProcess, tmp_path: Path
) -> None:
    """The whole model folder is a symlink to one outside the models folder, whose file is
    then replaced (written beside it and renamed over it)."""
    outside = tmp_path / "elsewhere"
    make_scripted(outside / "1" / "model.scripted", controls=())
    os.symlink(outside, server.models / "linked-folder")
    first = wait_until(lambda: serving_sha(server, "linked-folder"), 60, "the model to serve")
    assert first == sha_of(outside / "1" / "model.scripted")
    fresh = make_scripted(outside / "1" / ".model.scripted.tmp", controls=(), width=8)
    second = sha_of(fresh)
    os.replace(fresh, outside / "1" / "model.scripted")
    wait_until(lambda: serving_sha(server, "linked-folder") == second, 30, "the model to reload")
