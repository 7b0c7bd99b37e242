"""`infer --save DIR` against a server that names the outputs: a name that would write
outside DIR, or hidden, or no plain file name, is the server's fault (exit 1, nothing
written), and what already stands at DIR/NAME.npy (a symlink, a FIFO, a directory, a
file) is replaced whole or left, never written through. The server: conftest's
`model_server` (tests/fake_servers.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fake_servers import FakeServer, one_error_line, run


def _answer_with_outputs(*names: str) -> dict[str, Any]:
    outputs = [{"name": n, "datatype": "FP32", "shape": [1, 2], "data": [1, 2]} for n in names]
    return {"model_name": "m", "model_version": "1", "outputs": outputs}


@pytest.mark.parametrize(
    "name",
    ["../escaped", "ABSOLUTE", ".hidden", "..", "a/b", "a\\b", "a\x00b", "a\x1b[2Jb", "",
     "n" * 252],
    ids=["up-and-out", "absolute", "hidden", "dot-dot", "slash", "backslash", "nul", "esc",
         "empty", "too-long"],
)  # fmt: skip
def test_save_refuses_an_output_name_that_is_no_plain_file_name(
    model_server: FakeServer, tmp_path: Path, name: str
) -> None:
    """`infer --save DIR` wrote DIR/NAME.npy for each NAME the answer gave: `../x` and
    `/abs/x` were written outside DIR. An unsafe name is the server's fault (exit 1), and
    nothing is written, not even the outputs with good names."""
    if name == "ABSOLUTE":
        name = str(tmp_path / "absolute")
    model_server.json("/v2/models/m/infer", _answer_with_outputs("y", name))
    folder = tmp_path / "out" / "deeper"
    for json_flag in ([], ["--json"]):
        r = run("infer", "m", "x=[[1, 2]]", "--save", str(folder), "--url", model_server.url,
                *json_flag)  # fmt: skip
        assert r.code == 1, r
        said = json.loads(r.stdout)["error"] if json_flag else one_error_line(r)
        assert f"{model_server.url} answered with an output named {name!r}" in said, said
        assert f"Nothing was saved to {folder}." in said
        assert list(tmp_path.rglob("*")) == []  # nothing written, in DIR or out of it


@pytest.mark.timeout(20)  # (a FIFO that is opened blocks: fail, not hang for 120 s)
@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "private file", "long name"])
def test_save_replaces_what_is_at_a_name_and_never_writes_through_it(
    model_server: FakeServer, tmp_path: Path, kind: str
) -> None:
    """NAME.npy was opened as it stood: a symlink in DIR was written through (outside
    DIR), a FIFO blocked the command for ever. Each output is now written beside its
    name and renamed over it: a link or FIFO is replaced, a regular file keeps its mode,
    a directory there is a one-line error that leaves no file behind, and a name as long
    as a file name may be still saves (the file beside it has a name of its own length)."""
    name = "n" * 251 if kind == "long name" else "y"  # NAME.npy: 255 bytes, the most
    model_server.json("/v2/models/m/infer", _answer_with_outputs(name))
    folder, outside = tmp_path / "out", tmp_path / "outside.txt"
    folder.mkdir()
    outside.write_text("precious\n")
    at = folder / f"{name}.npy"
    mode = 0o666 & ~_umask()
    if kind == "symlink":
        at.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(at)
    elif kind == "directory":
        at.mkdir()
    elif kind == "private file":
        at.write_text("an older answer")
        at.chmod(mode := 0o600)
    r = run("infer", "m", "x=[[1, 2]]", "--save", str(folder), "--url", model_server.url)
    assert outside.read_text() == "precious\n"
    if kind == "directory":
        assert r.code == 1, r
        assert one_error_line(r).startswith(f"error: cannot save the outputs to {folder}: ")
        assert [p.name for p in folder.iterdir()] == [at.name]  # no file left beside it
        return
    assert r.code == 0, r
    assert not at.is_symlink()
    assert at.is_file()
    assert np.load(at).tolist() == [[1.0, 2.0]]
    assert [p.name for p in folder.iterdir()] == [at.name]
    assert at.stat().st_mode & 0o777 == mode


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
