"""The CLI against hostile or broken servers and inputs: a server that answers HTML, JSON
of another shape, an error page, a redirect, half an answer or nothing; odd addresses,
tokens, names, files and flags. Each mistake is one line and an exit code (1: the server
or a check, 2: usage), never a traceback or a hang.

The servers are fakes in this process (tests/fake_servers.py), each answering what its
test sets; README's contract ("CLI") is what is checked. `infergate bench` and the
dashboard against the same have files of their own (test_bench_hostile.py,
test_cli_top_hostile.py)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infergate.client import Client, ClientError, normalize_url
from tests.fake_servers import HTML_500, FakeServer, Route, one_error_line, run

ADMIN_COMMANDS = [
    ["model", "list"],
    ["model", "status", "m"],
    ["model", "load", "m"],
    ["tenant", "list"],
    ["tenant", "add", "t"],
    ["tenant", "set", "t", "rps=1"],
    ["breaker", "list"],
    ["breaker", "set", "m", "failure_rate=0.5"],
]


def test_an_answer_that_is_not_json_is_one_line(fake: FakeServer) -> None:
    fake.routes["*"] = Route(200, b"<html><title>Welcome to nginx!</title></html>", {})
    for command in ADMIN_COMMANDS:
        line = one_error_line(run(*command, "--url", fake.url))
        assert "with a body that is not JSON" in line, line
        assert "is it an infergate server" in line
        r = run(*command, "--url", fake.url, "--json")
        assert r.code == 1
        assert "not JSON" in json.loads(r.stdout)["error"]
    fake.routes["*"] = Route(200, b'[{"name": "\xff\xfe"}]')  # not UTF-8
    assert "not JSON" in one_error_line(run("model", "list", "--url", fake.url))
    fake.routes["*"] = Route(204, b"")
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert "with an empty body." in line
    assert line.endswith("(HTTP 204)")


@pytest.mark.parametrize(
    "body",
    ["[]", "{}", "[1]", "[{}]", "null", '"text"', '{"tenants": [{}]}', '[{"name": "m"}]'],
)
def test_json_of_another_shape_is_one_line_and_exit_1(fake: FakeServer, body: str) -> None:
    fake.routes["*"] = Route(200, body.encode())
    for command in ADMIN_COMMANDS:
        r = run(*command, "--url", fake.url)
        if r.code == 0:  # an empty list is a list; `{}` from a load or a PATCH is an answer
            continue
        line = one_error_line(r)
        assert r.code == 1, (command, r)
        assert "infergate server (of this version)" in line, line
    if body not in ("[]", "[{}]", '[{"name": "m"}]'):  # not an array: not `model list`'s shape
        r = run("model", "list", "--url", fake.url, "--json")
        assert r.code == 1, r
        assert "where infergate sends" in json.loads(r.stdout)["error"]


def test_error_pages_and_odd_error_bodies_are_one_line(fake: FakeServer) -> None:
    """Each on one line; an error body that is not infergate's `{"error": "..."}` (a
    proxy's page, another server's) names the URL and the request, as a redirect does:
    an HTML page was only "an HTML page: Error response (HTTP 404)"."""
    cases: list[tuple[Route, str]] = [
        (Route(500, HTML_500, {"Content-Type": "text/html"}), "an HTML page: 500 Internal"),
        (Route(400, json.dumps({"error": "one\ntwo\nthree"}).encode()), "one two three"),
        (Route(400, b"[1, 2]"), "[1,2]."),
        (Route(400, b'"just words"'), "just words."),
        (Route(400, b'{"error": null, "detail": "x"}'), '{"error":null,"detail":"x"}'),
        (Route(409, b'{"error": {"code": 5}}'), '{"code":5}.'),
        (Route(502, b"x" * 5000 + b"\n" * 50, {}), "…."),
        (Route(500, b"Internal Server Error", {}), "Internal Server Error"),
    ]
    for route, words in cases:
        fake.routes["*"] = route
        for command, request in (
            (["model", "list"], "GET /admin/models"),
            (["tenant", "remove", "t"], "DELETE /admin/tenants/t"),
        ):
            line = one_error_line(run(*command, "--url", fake.url))
            assert words in line, line
            assert line.endswith(f"(HTTP {route.status})"), line
            assert len(line) < 600, line
            theirs = f"error: {fake.url} answered {request} with an error that is not infergate's: "
            if words == "one two three":  # infergate's own: the server's words alone
                assert line == f"error: {words} (HTTP 400)", line
            elif route.body == b"Internal Server Error":  # uvicorn's, should the app fail
                assert line == "error: Internal Server Error (HTTP 500)", line
            else:
                assert line.startswith(theirs), line
                assert "Hint: is --url (or INFERGATE_URL) an infergate server" in line, line


def test_a_redirect_is_said_not_followed_nor_read_as_data(fake: FakeServer) -> None:
    fake.routes["*"] = Route(302, b"", {"Location": "https://login.example/sso"})
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert "with a redirect to https://login.example/sso" in line
    assert line.endswith("(HTTP 302)")
    assert fake.requests == ["GET /admin/models"]  # not followed


def test_half_an_answer_and_no_answer_are_said_as_such(fake: FakeServer) -> None:
    fake.routes["*"] = Route(200, json.dumps([{"name": "m"}] * 50).encode(), mode="cut")
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert f"{fake.url} broke off its answer to GET /admin/models" in line
    assert ".." not in line
    fake.routes["*"] = Route(mode="hang")
    with Client(fake.url, timeout_s=0.2) as c, pytest.raises(ClientError) as caught:
        c.models()
    assert caught.value.message.startswith(
        f"{fake.url} did not answer GET /admin/models within 0.2 s. Hint: is it an infergate"
    )


def test_an_https_url_to_a_plain_server_says_tls(fake: FakeServer) -> None:
    line = one_error_line(run("model", "list", "--url", fake.url.replace("http:", "https:")))
    assert "the TLS handshake failed" in line
    assert "use http://" in line


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:abc", "the port is not a number"),
        ("127.0.0.1:99999", "the port is not a number"),
        ("::::", "no host in it"),
        ("http://", "no host in it"),
        ("ftp://127.0.0.1:21", "not an http:// or https:// address"),
        ("http://gw example", "an address holds no spaces"),
        ("http://gw:8000/?a=1", "no ?query or #fragment"),
        ("http://gw:8000/v2", "give the server's own address (http://gw:8000): "),
        ("gw:8000/v2/health/ready", "give the server's own address (http://gw:8000): "),
        ("https://gw/ADMIN/models", "give the server's own address (https://gw): "),
    ],
)
def test_an_address_that_is_not_one_is_a_usage_error(url: str, words: str) -> None:
    for command in (["model", "list"], ["infer", "m", "x=[[1, 2]]"], ["bench", "m"]):
        r = run(*command, "--url", url)
        assert r.code == 2, (command, r)
        assert words in one_error_line(r)
    r = run("tenant", "list", env={"INFERGATE_URL": url})
    assert r.code == 2
    assert one_error_line(r).startswith(f"error: INFERGATE_URL {url!r}: ")
    r = run("top", "--url", url)
    assert (r.code, words in one_error_line(r)) == (2, True)


def test_an_address_with_a_proxys_prefix_is_one() -> None:
    """A prefix a proxy serves the gateway under is part of the address, even one named
    like an endpoint (/ml/admin, /api/v2): only an endpoint's URL pasted whole is refused."""
    for url in ("http://127.0.0.1:9/ml/admin", "http://127.0.0.1:9/api/v2"):
        line = one_error_line(run("model", "list", "--url", url))
        assert line.startswith(f"error: cannot reach infergate at {url}: "), line


def test_an_address_without_a_port_says_which_port_it_meant() -> None:
    """`--url 127.0.0.1` means port 80, not serve's 8000: the error said only "cannot reach
    infergate at http://127.0.0.1"."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 80)) == 0:  # a web server here: it answers
            pytest.fail("this test needs nothing listening on 127.0.0.1:80")
    line = one_error_line(run("model", "list", "--url", "127.0.0.1"))
    assert line.startswith("error: cannot reach infergate at http://127.0.0.1: "), line
    assert line.endswith("(it names no port, so port 80; `infergate serve` listens on 8000)")


def test_a_token_no_header_can_carry_is_a_usage_error(fake: FakeServer) -> None:
    for token in ("clé", "a\nb"):
        r = run("model", "list", "--url", fake.url, env={"INFERGATE_ADMIN_TOKEN": token})
        assert r.code == 2
        assert "the token holds characters an HTTP header cannot carry" in one_error_line(r)
        r = run("infer", "m", "x=[[1, 2]]", "--url", fake.url, "--token", token)
        assert r.code == 2
    assert fake.requests == []


def test_dot_names_stay_out_of_the_path(fake: FakeServer) -> None:
    """`.` and `..` are path steps: `model unload .` was POST /v2/repository/models/unload
    (a model named "unload"), and a version `../../echo` reached model echo."""
    for command in (
        ["model", "unload", "."],
        ["model", "status", ".."],
        ["breaker", "reset", ".."],
        ["tenant", "remove", "."],
        ["infer", "..", "x=[[1, 2]]"],
    ):
        r = run(*command, "--url", fake.url)
        assert r.code == 2, (command, r)
        assert "not a name (empty, . or ..)" in one_error_line(r)
    assert fake.requests == []
    fake.json("*", {"error": "no such version"}, 404)
    run("infer", "m", "x=[[1, 2]]", "--model-version", "1/../../echo", "--url", fake.url)
    assert fake.requests == ["GET /v2/models/m/versions/1%2F..%2F..%2Fecho"]


TENANT_NAME_LINE = "error: tenant name {!r}: letters, digits and _ only, not starting with a digit"
SLASH_LINE = (
    "error: tenant name {!r}: a tenant's name has no '/' (the admin API could not address "
    "it). Hint: infergate tenant list"
)


@pytest.mark.parametrize("name", ["a/b", "../admin", "a?b", "9lives", "team-a", "a b"])
def test_a_tenant_name_the_server_would_not_add_is_a_usage_error(
    fake: FakeServer, name: str
) -> None:
    """The server's rule for a new tenant's name (an identifier) holds where a tenant is
    made (`tenant add`, `key new`)."""
    for command in (
        ["tenant", "add", name, "rps=1", "--url", fake.url],
        ["key", "new", "--tenant", name],
    ):
        r = run(*command)
        assert (r.code, one_error_line(r)) == (2, TENANT_NAME_LINE.format(name)), command
    r = run("tenant", "add", name, "rps=1", "--url", fake.url, "--json")
    assert (r.code, r.stderr) == (2, "")
    assert json.loads(r.stdout) == {"error": TENANT_NAME_LINE.format(name)[7:]}
    assert fake.requests == []


@pytest.mark.parametrize("name", ["a/b", "../admin"])
def test_a_tenant_name_with_a_slash_is_a_usage_error_where_one_is_named(
    fake: FakeServer, name: str
) -> None:
    """`tenant set a/b` was PATCH /admin/tenants/a%2Fb, which the server reads as two path
    steps (it decodes the path before routing) and answered with a 404 that named no
    tenant."""
    for command in (["tenant", "set", name, "rps=1"], ["tenant", "remove", name]):
        r = run(*command, "--url", fake.url)
        assert (r.code, one_error_line(r)) == (2, SLASH_LINE.format(name)), command
        r = run(*command, "--url", fake.url, "--json")
        assert (r.code, r.stderr) == (2, "")
        assert json.loads(r.stdout) == {"error": SLASH_LINE.format(name)[7:]}
    assert fake.requests == []


MODEL_NAME_LINE = (
    "error: {!r} is not a model name: a model is a folder or file in the repository, named "
    "with letters, digits, '_', '-' and '.', starting with a letter or digit. Hint: "
    "infergate model list"
)


@pytest.mark.parametrize("name", ["a/b", "../etc", "a?b", ".hidden", "_x", "dig its"])
def test_a_model_name_no_repository_could_hold_is_a_usage_error(
    fake: FakeServer, name: str
) -> None:
    """`model load a/b` was POST /v2/repository/models/a%2Fb/load, which the server reads
    as more path steps (it decodes the path before routing) and answered "no such
    endpoint" (exit 1): the server's rule for a model's name holds in every command that
    puts one in a path."""
    for command in (
        *(["model", action, name] for action in ("load", "reload", "unload", "status")),
        ["infer", name, "x=[[1, 2]]"],
        ["bench", name, "--duration", "0.1"],
        ["breaker", "set", name, "failure_rate=0.5"],
        ["breaker", "reset", name],
    ):
        r = run(*command, "--url", fake.url)
        assert (r.code, one_error_line(r)) == (2, MODEL_NAME_LINE.format(name)), command
        r = run(*command, "--url", fake.url, "--json")
        assert (r.code, r.stderr) == (2, ""), command
        assert json.loads(r.stdout) == {"error": MODEL_NAME_LINE.format(name)[7:]}
    assert fake.requests == []


def test_every_name_the_repository_serves_is_still_a_model_name(fake: FakeServer) -> None:
    fake.json("*", {"name": "x", "versions": [], "default_version": None})
    for name in ("digits", "Model_2.v1", "9lives", "a-b"):
        assert run("model", "unload", name, "--url", fake.url).code == 0, name
    assert fake.requests[::2] == [
        f"POST /v2/repository/models/{n}/unload" for n in ("digits", "Model_2.v1", "9lives", "a-b")
    ]


def test_a_hand_written_tenant_name_is_still_reached_by_set_and_remove(fake: FakeServer) -> None:
    """A profile written by hand may name a tenant "team-a" (only `tenant add` holds new
    names to the server's rule): set and remove send it as one escaped segment."""
    fake.json("*", {"name": "team-a", "rps": 1})
    assert run("tenant", "set", "team-a", "rps=1", "--url", fake.url).code == 0
    assert run("tenant", "remove", "team a?", "--url", fake.url).code == 0
    assert fake.requests == ["PATCH /admin/tenants/team-a", "DELETE /admin/tenants/team%20a%3F"]


def test_the_client_escapes_every_name_it_puts_in_a_path(fake: FakeServer) -> None:
    """A name or version is one path segment whatever it holds: `/`, `?` and `#` escaped,
    and `.` and `..` too, which a URL would otherwise read as steps to another endpoint."""
    fake.json("*", {})
    with Client(fake.url) as c:
        c.remove_tenant("a/b")
        c.set_tenant("..", {"rps": 1})
        c.reset_breaker("m/../../admin")
        c.set_breaker(".", {"probes": 1})
        c.load_model(".")
        c.unload_model("a?b#c")
        c.model("..")
        c.infer_raw("..", b"{}", {}, version=".")
        for empty in (lambda: c.remove_tenant(""), lambda: c.metadata("")):
            with pytest.raises(ValueError, match="an empty name"):
                empty()
    assert fake.requests == [
        "DELETE /admin/tenants/a%2Fb",
        "PATCH /admin/tenants/%2E%2E",
        "POST /admin/breakers/m%2F..%2F..%2Fadmin/reset",
        "PATCH /admin/breakers/%2E",
        "POST /v2/repository/models/%2E/load",
        "POST /v2/repository/models/a%3Fb%23c/unload",
        "GET /admin/models/%2E%2E",
        "POST /v2/models/%2E%2E/versions/%2E/infer",
    ]


def test_infer_odd_input_files_are_usage_errors(model_server: FakeServer, tmp_path: Path) -> None:
    np.save(tmp_path / "complex.npy", np.array([[1 + 2j, 3j]]))
    np.save(tmp_path / "when.npy", np.array(["2020-01-01"], dtype="datetime64[D]"))
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "dir.npy").mkdir()
    (tmp_path / "ragged.json").write_text("[[1, 2], [3]]")
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    os.mkfifo(tmp_path / "fifo.npy")
    cases = [
        ("complex.npy", "complex128 has no KServe V2 datatype"),
        ("when.npy", "datetime64[D] has no KServe V2 datatype"),
        ("dir.json", "dir.json: not a regular file"),
        ("dir.npy", "dir.npy: not a regular file"),
        ("fifo.npy", "fifo.npy: not a regular file"),  # not opened: it would wait for a writer
        ("missing.json", "missing.json: no such file"),
        ("ragged.json", "ragged (rows of different lengths)"),
        ("deep.json", "deep.json: not JSON (depth limit exceeded"),
    ]
    for name, words in cases:
        r = run("infer", "m", f"x={tmp_path / name}", "--url", model_server.url)
        assert r.code == 2, (name, r)
        assert words in one_error_line(r), name
    for literal in ("[[null, 1]]", '{"a": 1}', "[[1e999, 1]]"):
        r = run("infer", "m", f"x={literal}", "--url", model_server.url)
        assert r.code == 2, (literal, r)
        one_error_line(r)
    r = run("infer", "m", "x=[[1, 2]]", "x=[[3, 4]]", "--url", model_server.url)
    assert r.code == 2
    assert "input 'x' is given twice" in one_error_line(r)
    assert "POST /v2/models/m/infer" not in model_server.requests  # none was sent


@pytest.mark.parametrize(
    ("answer", "header_length", "words"),
    [
        (b"hello", None, "unexpected character"),
        (b"[1]", None, "the JSON is an array, not an object"),
        (b'{"outputs": null, "model_name": "m"}', None, ""),  # no outputs: a table of none
        (b'{"outputs": [{"name": "y", "datatype": "FP32"}]}', None, "KeyError: 'shape'"),
        (b'{"outputs": [{"name": 5, "datatype": "FP32", "shape": [1], "data": [1]}]}', None,
         "name and datatype are not strings"),
        (b'{"outputs": [{"name": "y", "datatype": "FP99", "shape": [1], "data": [1]}]}', None,
         "unknown datatype 'FP99'"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [5], "data": [1]}]}', None,
         "cannot reshape"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": ["a"]}]}', None,
         "could not convert"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None,
         "has the shape [-1]"),
        (b'{"outputs": []}', "abc", "Inference-Header-Content-Length 'abc' does not fit"),
        (b'{"outputs": []}', "-5", "Inference-Header-Content-Length '-5' does not fit"),
        (b'{"outputs": []}', "99", "Inference-Header-Content-Length '99' does not fit"),
        (b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [4], '
         b'"parameters": {"binary_data_size": 16}}]}', "json",
         "binary_data_size 16 runs past the body"),
        (b'{"model_name": 5, "model_version": {"a": 1}, "outputs": [{"name": "y", '
         b'"datatype": "FP32", "shape": [1], "data": [1]}]}', None, ""),
    ],
)  # fmt: skip
def test_infer_an_answer_that_is_not_a_v2_response_is_one_line(
    model_server: FakeServer, answer: bytes, header_length: str | None, words: str
) -> None:
    headers = {"Content-Type": "application/json"}
    if header_length is not None:  # "json": the JSON's own length (no binary data after it)
        length = str(len(answer)) if header_length == "json" else header_length
        headers["Inference-Header-Content-Length"] = length
    model_server.routes["/v2/models/m/infer"] = Route(200, answer, headers)
    for json_flag in ([], ["--json"]):
        r = run("infer", "m", "x=[[1, 2]]", "--url", model_server.url, *json_flag)
        if not words:  # readable, if odd: shown
            assert r.code == 0, r
            continue
        assert r.code == 1, r
        said = json.loads(r.stdout)["error"] if json_flag else one_error_line(r)
        assert "with something that is not a V2 inference response (" in said, said
        assert words in said, said


@pytest.mark.parametrize(
    "metadata",
    [[], {"inputs": [5]}, {"inputs": [{"name": "x"}]}, {"inputs": [{"name": "x",
     "datatype": "WAT", "shape": [1]}]}, {"inputs": [{"name": "x", "datatype": "FP32",
     "shape": None}]}, {"inputs": {"x": 1}}],
)  # fmt: skip
def test_odd_model_metadata_is_one_line(model_server: FakeServer, metadata: Any) -> None:
    model_server.json("/v2/models/m", metadata)
    for command in (["infer", "m", "x=[[1, 2]]"], ["bench", "m", "--duration", "0.1"]):
        r = run(*command, "--url", model_server.url)
        assert r.code == 1, (command, r)
        assert "answered GET /v2/models/m with" in one_error_line(r)
    assert "POST /v2/models/m/infer" not in model_server.requests


def test_key_new_write_to_an_odd_profile_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "folder.toml").mkdir()
    (tmp_path / "bad.toml").write_text("{not toml")
    (tmp_path / "string.toml").write_text('[server]\nadmin_keys = "sha256:abc"\n')
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe[server]")
    cases = [
        ("folder.toml", "cannot read"),
        ("bad.toml", "not valid TOML"),
        ("string.toml", "server.admin_keys is not a list"),
        ("binary.toml", "not valid TOML: not UTF-8"),
        ("missing/x.toml", "cannot write"),
    ]
    for name, words in cases:
        r = run("key", "new", "--admin", "--write", "--profile", str(tmp_path / name))
        assert r.code == 2, (name, r)
        assert words in one_error_line(r)
    assert (tmp_path / "string.toml").read_text() == '[server]\nadmin_keys = "sha256:abc"\n'


def test_model_keygen_sign_verify_on_odd_paths(tmp_path: Path) -> None:
    r = run("model", "keygen", str(tmp_path / "missing" / "k"))
    assert r.code == 2
    assert "cannot write the key to" in one_error_line(r)
    (tmp_path / "old.pub").write_text("a public key someone trusts")
    r = run("model", "keygen", str(tmp_path / "old"))
    assert r.code == 2  # its .pub would have been overwritten
    assert (tmp_path / "old.pub").read_text() == "a public key someone trusts"
    assert not (tmp_path / "old").exists()
    assert run("model", "keygen", str(tmp_path / "k")).code == 0
    (tmp_path / "dir.onnx").mkdir()
    for command in (["sign", str(tmp_path / "dir.onnx"), "--key", str(tmp_path / "k")],
                    ["verify", str(tmp_path / "dir.onnx")]):  # fmt: skip
        r = run("model", *command)
        assert r.code == 2
        assert "not a regular file" in one_error_line(r)
    model = tmp_path / "model.onnx"
    model.write_bytes(b"weights")
    r = run("model", "verify", str(model), "--sha256", "abc")
    assert r.code == 1
    line = one_error_line(r)
    assert "not the 'abc' of --sha256" in line
    assert "model.toml" not in line  # no model.toml was involved


def test_settings_given_twice_or_an_empty_list_are_usage_errors(fake: FakeServer) -> None:
    for settings, words in (
        (["rps=1", "rps=2"], "rps is given twice"),
        (["models="], "models=[] says none"),
        (["models=,,"], "models=[] says none"),
    ):
        r = run("tenant", "set", "t", *settings, "--url", fake.url)
        assert r.code == 2, (settings, r)
        assert words in one_error_line(r)
    assert fake.requests == []
    fake.json("/admin/tenants/t", {"name": "t"})
    r = run("tenant", "set", "t", "rps=null", 'models=["a"]', "--url", fake.url)
    assert r.stdout == 'tenant t: rps = null (its default applies), models = ["a"]\n'


def test_an_unexpected_error_is_one_line_unless_tracebacks_are_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from infergate.cli import main as entry

    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr("infergate.cli.doctor._python", broken)
    monkeypatch.setattr("sys.argv", ["infergate", "doctor"])
    with pytest.raises(SystemExit) as done:
        entry.main()
    assert done.value.code == 1
    assert capsys.readouterr().err == (
        "error: unexpected RuntimeError: a bug over two lines. Hint: this is a bug in "
        "infergate; INFERGATE_TRACEBACKS=1 shows where, for a report\n"
    )
    monkeypatch.setenv("INFERGATE_TRACEBACKS", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        entry.main()


def test_normalize_url_keeps_what_worked() -> None:
    assert normalize_url("localhost:8000") == "http://localhost:8000"
    assert normalize_url(" https://gw.example:9000/ ") == "https://gw.example:9000"
    assert normalize_url("[::1]:8000") == "http://[::1]:8000"
    assert normalize_url("http://gw/prefix/") == "http://gw/prefix"
