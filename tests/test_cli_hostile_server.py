"""The CLI against a server that means harm, beyond answers of the wrong shape
(test_cli_hostile.py) and the output names `infer --save` writes (test_cli_save.py):
control characters meant for the terminal, answers that drip or never end, metadata whose
shapes no machine could hold; and the profile files the CLI reads (a FIFO, /dev/zero).
Each is one line and an exit code: never a raw escape sequence, a hang or gigabytes of
memory.

The servers: tests/fake_servers.py's FakeServer (conftest's `fake`) where an answer is
bytes sent at once, and tests/raw_servers.py's RawServer for answers sent over time (a
byte at a time, or without end)."""

from __future__ import annotations

import datetime
import gzip
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from tests.fake_servers import METADATA, FakeServer, Route, one_error_line, run
from tests.raw_servers import HOSTILE, HOSTILE_ESCAPED, assert_inert, raw_server

# An error is one line: its whitespace runs (the CR) as one space.
HOSTILE_ONE_LINE = HOSTILE_ESCAPED.replace("\\r", " ")


# --- control characters: nothing a server sends reaches the terminal raw -------------


def test_a_servers_error_text_is_escaped(fake: FakeServer) -> None:
    fake.json("*", {"error": HOSTILE}, 400)
    for command in (["model", "list"], ["infer", "m", "x=[[1, 2]]"], ["tenant", "remove", "t"]):
        r = run(*command, "--url", fake.url)
        assert r.code == 1, (command, r)
        assert_inert(r.stderr)
        assert f"error: {HOSTILE_ONE_LINE} (HTTP 400)" == one_error_line(r)
    r = run("model", "list", "--url", fake.url, "--json")
    assert json.loads(r.stdout) == {"error": f"{HOSTILE_ONE_LINE} (HTTP 400)"}


def test_infer_escapes_the_names_and_strings_of_an_answer(model_server: FakeServer) -> None:
    answer = {
        "model_name": "m\x1b[2J",
        "model_version": "1\r",
        "outputs": [{"name": "y\x1b[31m", "datatype": "BYTES", "shape": [1], "data": [HOSTILE]}],
    }
    model_server.json("/v2/models/m/infer", answer)
    r = run("infer", "m", "x=[[1, 2]]", "--url", model_server.url)
    assert r.code == 0, r
    assert_inert(r.stdout)
    assert r.stdout.startswith("m\\x1b[2J version 1\\r\n")
    assert "y\\x1b[31m" in r.stdout
    assert "sad \\x1b]0;PWNED\\x07" in r.stdout
    # JSON keeps the strings as they are, escaped the JSON way
    r = run("infer", "m", "x=[[1, 2]]", "--url", model_server.url, "--json")
    assert r.code == 0, r
    assert_inert(r.stdout)
    doc = json.loads(r.stdout)
    assert (doc["model_name"], doc["outputs"][0]["name"]) == ("m\x1b[2J", "y\x1b[31m")
    assert doc["outputs"][0]["data"] == [HOSTILE]


MODEL_WITH_A_REASON = {
    "name": "m\x1b[1m",
    "state": "failed",
    "reason": f"line one\nerror: FORGED\t{HOSTILE}",
    "default_version": None,
    "versions": [],
    "failures": {"2\x1b": "bad\rfile"},
    "events": [{"time": 0, "kind": "load\x1b", "version": None, "message": "x\nFORGED"}],
}


def test_model_list_and_status_escape_the_servers_text(fake: FakeServer) -> None:
    fake.json("/admin/models", [MODEL_WITH_A_REASON])
    r = run("model", "list", "--url", fake.url)
    assert r.code == 0, r
    assert_inert(r.stdout)
    assert "\\x1b]0;PWNED" in r.stdout
    r = run("model", "list", "--format", "tsv", "--url", fake.url)
    assert_inert(r.stdout)
    lines = r.stdout.splitlines()
    assert lines[1:] == [  # its failed version, its reason
        "m\\x1b[1m\t2\\x1b\tfailed\t-\t-\tbad\\rfile",
        f"m\\x1b[1m\t-\tfailed\t-\t-\tline one\\nerror: FORGED\\t{HOSTILE_ESCAPED}",
    ]
    r = run("model", "list", "--json", "--url", fake.url)
    assert_inert(r.stdout)  # DEL and C1 as \u escapes too, which JSON does not ask for
    assert json.loads(r.stdout) == [MODEL_WITH_A_REASON]
    fake.json("/admin/models/m", MODEL_WITH_A_REASON)
    r = run("model", "status", "m", "--url", fake.url)
    assert r.code == 0, r
    assert_inert(r.stdout)
    assert not any(line.startswith(("error: FORGED", "FORGED")) for line in r.stdout.splitlines())
    assert "version 2\\x1b did not load: bad\\rfile" in r.stdout


def test_a_tenants_key_and_a_usage_error_quoting_the_server_are_escaped(
    fake: FakeServer,
) -> None:
    fake.json("/admin/tenants", {"name": "t", "api_key": "ig_\x1b[2Jkey"})
    r = run("tenant", "add", "t", "--url", fake.url)
    assert r.code == 0, r
    assert_inert(r.stdout)
    assert r.stdout.endswith("ig_\\x1b[2Jkey\n")
    # A usage error lists the model's inputs, whose names the server gives.
    inputs = [{"name": f"in{i}\x1b[2J", "datatype": "FP32", "shape": [-1, 2]} for i in range(2)]
    fake.json("/v2/models/m", {**METADATA, "inputs": inputs})
    r = run("infer", "m", "[[1, 2]]", "--url", fake.url)
    assert r.code == 2, r
    assert_inert(r.stderr)
    assert "the model's inputs are in0\\x1b[2J, in1\\x1b[2J" in one_error_line(r)


def test_bench_escapes_the_servers_error_text_in_its_failures(model_server: FakeServer) -> None:
    model_server.json("/v2/models/m/infer", {"error": HOSTILE}, 400)
    r = run("bench", "m", "--duration", "0.1", "--windows", "1", "--url", model_server.url)
    assert r.code == 1, r
    assert_inert(r.stdout + r.stderr)
    assert HOSTILE_ONE_LINE in r.stdout


# --- answers sent over time: one deadline for the whole request ---------------------


DRIP_S = 0.05  # between two bytes: each read gets one long before any per-read timeout
# How long an answer drips before its server gives up: a bound on a CLI that would wait
# for it (so that a missed deadline fails the test rather than hangs it), not a delay.
DRIP_FOR_S = 30.0


def _drip(conn: socket.socket, stop: threading.Event, byte: bytes) -> None:
    ends = time.monotonic() + DRIP_FOR_S
    while not stop.wait(DRIP_S) and time.monotonic() < ends:
        conn.sendall(byte)


def drip_body(conn: socket.socket, line: str, stop: threading.Event) -> None:
    """The whole head at once, then the body a byte at a time, for DRIP_FOR_S."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"content-length: 100000\r\n\r\n[")  # fmt: skip
    _drip(conn, stop, b" ")


def drip_head(conn: socket.socket, line: str, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nx-slow: ")
    _drip(conn, stop, b"a")


DEADLINE_S = 0.3


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> float:
    """The CLI's deadline per request (30 s, as README says), made short."""
    monkeypatch.setattr("infergate.client.DEFAULT_TIMEOUT_S", DEADLINE_S)
    return DEADLINE_S


def timed(*args: str) -> tuple[str, float]:
    start = time.monotonic()
    r = run(*args)
    took = time.monotonic() - start
    assert r.code == 1, r
    return one_error_line(r), took


def test_an_answer_that_drips_ends_at_the_deadline(short_deadline: float) -> None:
    """A server that sends its head, then a byte every few seconds, held the CLI for ever:
    httpx's timeout is per read. The deadline is for the whole request."""
    with raw_server(drip_body) as url:
        for command, request in (
            (["model", "list"], "GET /admin/models"),
            (["infer", "m", "x=[[1, 2]]"], "GET /v2/models/m"),
            (["tenant", "remove", "t"], "DELETE /admin/tenants/t"),
        ):
            line, took = timed(*command, "--url", url)
            assert line.startswith(
                f"error: {url} did not finish its answer to {request} within 0.3 s (it had sent "
            ), line
            assert took < DRIP_FOR_S, took  # cut off, not waited out
    with raw_server(drip_head) as url:
        line, took = timed("model", "list", "--url", url)
        assert line.startswith(f"error: {url} did not answer GET /admin/models within 0.3 s.")
        assert took < DRIP_FOR_S, took


def test_infer_takes_a_deadline_of_its_own(short_deadline: float) -> None:
    """An inference may take longer for good reasons (a slow model, a large answer on a
    slow link): `infer --timeout` sets its deadline, and the error names the option."""

    def slow_model(conn: socket.socket, line: str, stop: threading.Event) -> None:
        if line.startswith("POST"):
            stop.wait(short_deadline * 3)  # longer than the default deadline, not --timeout
            body = json.dumps(
                {
                    "model_name": "m",
                    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [3, 4]}],
                }
            ).encode()
        else:
            body = json.dumps(METADATA).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    with raw_server(slow_model) as url:
        line, _ = timed("infer", "m", "x=[[1, 2]]", "--url", url)
        assert line.endswith("needs infergate infer --timeout"), line
        r = run("infer", "m", "x=[[1, 2]]", "--url", url, "--timeout", "20", "--json")
        assert r.code == 0, r
        assert json.loads(r.stdout)["outputs"][0]["data"] == [3.0, 4.0]


def test_an_answer_that_drips_over_tls_ends_at_the_deadline(
    short_deadline: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS wraps the connection's socket in another: the one the deadline held was then
    detached, its shutdown failed unseen, and an https answer dripped for as long as the
    server liked."""
    tls, ca = _self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # httpx trusts it (trust_env)
    with raw_server(drip_body, tls) as url:
        line, took = timed("model", "list", "--url", url)
    assert line.startswith(f"error: {url} did not finish its answer to GET /admin/models "), line
    assert took < DRIP_FOR_S, took


@pytest.mark.parametrize("stale", ["gone.pem", "no-certificate.pem"])
def test_certificates_that_cannot_load_stop_only_https_and_are_named(
    fake: FakeServer, tmp_path: Path, stale: str
) -> None:
    """A stale SSL_CERT_FILE (a file gone, or one with no certificate in it) crashed every
    command, plain http ones too, as "unexpected FileNotFoundError ... a bug in infergate".
    Only an https server needs it, and there it is a usage mistake that names it."""
    (tmp_path / "no-certificate.pem").write_text("not a certificate\n")
    env = {"SSL_CERT_FILE": str(tmp_path / stale)}
    fake.json("/admin/models", [])
    r = run("model", "list", "--url", fake.url, "--json", env=env)
    assert (r.code, json.loads(r.stdout)) == (0, []), r
    for command in (["model", "list"], ["top"]):
        r = run(*command, "--url", "https://127.0.0.1:9", env=env)
        line = one_error_line(r)
        assert r.code == 2, r
        assert line.startswith("error: https://127.0.0.1:9: cannot load the certificates "), line
        assert f"(SSL_CERT_FILE={str(tmp_path / stale)!r})" in line, line
        assert line.endswith("Hint: point SSL_CERT_FILE at PEM certificates, or unset it"), line


def _self_signed(folder: Path) -> tuple[ssl.SSLContext, Path]:
    """A server context for 127.0.0.1 with a certificate of its own, and that certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context, cert_file


def test_a_load_waits_for_the_server_but_not_for_a_dripping_answer(
    short_deadline: float,
) -> None:
    """`model load` waits as long as the server works (no deadline until the answer's
    head), then the answer must come whole within the deadline."""
    model = {"name": "m", "default_version": "1", "versions": []}

    def slow_load(conn: socket.socket, line: str, stop: threading.Event) -> None:
        if line.startswith("POST"):
            stop.wait(short_deadline * 2)  # a load that takes longer than the deadline
        body = json.dumps(model if line.startswith("GET") else {}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    with raw_server(slow_load) as url:
        r = run("model", "load", "m", "--url", url)
        assert (r.code, r.stdout) == (0, "m: loaded, version 1 serving\n"), r
    with raw_server(drip_body) as url:
        line, _ = timed("model", "load", "m", "--url", url)
        assert "did not finish its answer to POST /v2/repository/models/m/load within" in line


# --- answers without end: read up to a cap, refused past it ---------------------------


def endless_body(conn: socket.socket, line: str, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
    chunk = b" " * (1 << 20)
    while not stop.is_set():
        conn.sendall(chunk)


def test_an_answer_past_the_cap_is_refused_unread(fake: FakeServer) -> None:
    """The CLI read whatever came: 800 MB of answer took 1.65 GB. An answer that is not an
    inference's is at most 16 MB (infergate's are far smaller)."""
    said = f"error: {fake.url} answered GET /admin/models with more than 16 MB ("
    hint = "), which is not read. Hint: is it an infergate server (of this version)?"
    fake.routes["*"] = Route(mode="raw", raw=b"HTTP/1.1 200 OK\r\ncontent-type: application/json"
                             b"\r\ncontent-length: 838860800\r\n\r\n[")  # fmt: skip
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert line.startswith(f"{said}its Content-Length says 838860800 bytes{hint}"), line
    # 17 MB of gzip'd spaces in 17 KB: counted as they unpack
    bomb = gzip.compress(b" " * (17 << 20))
    fake.routes["*"] = Route(200, bomb, {"Content-Type": "application/json",
                                         "Content-Encoding": "gzip"})  # fmt: skip
    line = one_error_line(run("model", "list", "--url", fake.url))
    assert line.startswith(f"{said}it went on past that{hint}"), line
    with raw_server(endless_body) as url:
        line = one_error_line(run("tenant", "list", "--url", url))
        assert line.startswith(
            f"error: {url} answered GET /admin/tenants with more than 16 MB (it went on past that)"
        ), line


def test_infer_reads_an_answer_up_to_max_answer_mb(model_server: FakeServer) -> None:
    blob = np.ones(1 << 19, dtype="<f4").tobytes()  # 2 MB
    output = {"name": "y", "datatype": "FP32", "shape": [1, 1 << 19],
              "parameters": {"binary_data_size": len(blob)}}  # fmt: skip
    head = json.dumps({"model_name": "m", "model_version": "1", "outputs": [output]}).encode()
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": str(len(head))}  # fmt: skip
    model_server.routes["/v2/models/m/infer"] = Route(200, head + blob, headers)
    r = run("infer", "m", "x=[[1, 2]]", "--max-answer-mb", "1", "--url", model_server.url)
    assert r.code == 1, r
    assert one_error_line(r) == (
        f"error: {model_server.url} answered POST /v2/models/m/infer with more than 1 MB (its "
        f"Content-Length says {len(head) + len(blob)} bytes), which is not read. Hint: if the "
        "model's outputs are that large, raise infergate infer's --max-answer-mb (HTTP 200)"
    )
    r = run("infer", "m", "x=[[1, 2]]", "--max-answer-mb", "3", "--url", model_server.url)
    assert r.code == 0, r
    assert "[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, …]" in r.stdout


# --- metadata: shapes from the server, bounded ----------------------------------------


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([-1, 12000, 12000], "gives inputs (x FP32 [-1, 12000, 12000]) of 549.3 MB for one row"),
        ([-1, 2**31, 2**31], "of about 2^64 bytes for one row"),
        ([1] * 70, "an input that is not a name, a V2 datatype and a shape (of at most 32"),
    ],
)
def test_bench_refuses_metadata_whose_shapes_no_request_could_hold(
    model_server: FakeServer, shape: list[int], words: str
) -> None:
    """bench made its random inputs from the shapes the metadata gave: [-1, 12000, 12000]
    FP32 took 1.7 GB, [-1, 2**31, 2**31] was numpy's bare error and exit 2."""
    metadata = {**METADATA, "inputs": [{"name": "x", "datatype": "FP32", "shape": shape}]}
    model_server.json("/v2/models/m", metadata)
    r = run("bench", "m", "--duration", "0.1", "--windows", "1", "--url", model_server.url)
    assert r.code == 1, r
    line = one_error_line(r)
    assert line.startswith(f"error: {model_server.url} answered GET /v2/models/m with "), line
    assert words in line
    assert "POST /v2/models/m/infer" not in model_server.requests


def test_bench_batch_past_the_cap_is_a_usage_error(model_server: FakeServer) -> None:
    r = run("bench", "m", "--batch", str(10**12), "--duration", "0.1", "--url", model_server.url)
    assert r.code == 2, r
    assert one_error_line(r).startswith(
        f"error: --batch {10**12} and the dimensions of the model's inputs make requests of "
    )
    assert "POST /v2/models/m/infer" not in model_server.requests


def test_infer_refuses_metadata_with_more_dimensions_than_an_array_has(
    model_server: FakeServer,
) -> None:
    metadata = {**METADATA, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1] * 70}]}
    model_server.json("/v2/models/m", metadata)
    r = run("infer", "m", "x=[[1, 2]]", "--url", model_server.url)
    assert r.code == 1, r
    assert "answered GET /v2/models/m with an input that is not" in one_error_line(r)
    assert "POST /v2/models/m/infer" not in model_server.requests


# --- profile files the CLI reads: regular files only, bounded -------------------------


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real command in a subprocess: a read that blocks hangs it, not the test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERGATE_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "infergate", *args],
        capture_output=True, text=True, check=False, env=env, cwd=cwd, timeout=20,
    )  # fmt: skip


def special_file(kind: str, path: Path) -> str:
    """A profile that is no regular file (a FIFO, /dev/zero through a link), or one too
    large to be a profile; the words the CLI says of it."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        with path.open("wb") as f:
            f.truncate(17 << 20)  # sparse: nothing is written
        return "larger than 16 MiB; it is not read"
    return "not a regular file; it is not read"


def one_line_of(done: subprocess.CompletedProcess[str]) -> str:
    assert done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "too_large"])
def test_key_new_write_refuses_a_profile_that_is_no_regular_file(tmp_path: Path, kind: str) -> None:
    """`key new --write --profile FIFO` hung; on /dev/zero it grew to 3 GB."""
    profile = tmp_path / "profile.toml"
    words = special_file(kind, profile)
    done = cli("key", "new", "--admin", "--write", "--profile", str(profile))
    assert done.returncode == 2, done
    assert one_line_of(done) == f"error: {profile}: {words}" + (
        ". Hint: put the file itself there (a symlink to a regular file is fine)"
        if kind != "too_large"
        else ". Hint: is this the right file?"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.toml"]  # no temp file left


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_project_profile_that_is_no_regular_file_is_a_usage_error(
    tmp_path: Path, fake: FakeServer, kind: str
) -> None:
    """Without --url the CLI reads ./profiles/default.toml for the server's port: a FIFO
    there hung `model list`, a link to /dev/zero grew it by gigabytes."""
    (tmp_path / "profiles").mkdir()
    words = special_file(kind, tmp_path / "profiles" / "default.toml")
    done = cli("model", "list", cwd=tmp_path)
    assert done.returncode == 2, done
    assert one_line_of(done) == (
        "error: profiles/default.toml, read for the port of the server started here (--url "
        f"or INFERGATE_URL skips it): {words}. Hint: put the file itself there (a symlink to "
        "a regular file is fine)"
    )
    fake.json("/admin/models", [])
    done = cli("model", "list", "--json", "--url", fake.url, cwd=tmp_path)  # not read
    assert (done.returncode, done.stdout) == (0, "[]\n"), done
