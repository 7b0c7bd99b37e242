"""What the fronts-parity tests (tests/test_fronts_parity_*.py) share: the pair of
gateways they compare, one process and one behind a front on the same models, with the
tenants and keys of its profile (conftest's `warm` starts it once for the files that use
it), and requests as raw HTTP bytes, sent and answered as bytes, so that two answers can
be compared byte for byte."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from onnx import helper

from infergate.engine.admission.tenants import hash_key
from tests.onnx_models import ECHO_TYPES, OPSET, _save, make_mlp
from tests.polling import wait_until
from tests.scripted_runtime import make_scripted
from tests.server import ServerProcess
from tests.triton_models import make_simple, make_simple_string

KEY, SLOW, SINGLE, REVOKED = "parity-key", "slow-key", "single-key", "revoked-key"
NUMBERS = [t for t in ECHO_TYPES if t != "BYTES"]
ID = "parity-1"  # every request's X-Request-ID, so that answers can be the same


def _profile(fronts: int, revoked: bool = False) -> str:
    keys = "[]" if revoked else f'["{hash_key(REVOKED)}"]'
    return (
        f"[server]\nfronts = {fronts}\nmax_request_mb = 0.5\nallow_anonymous = true\n\n"
        # The batch class (a 30 s queue deadline): on a busy machine the burst class's 200 ms
        # expired a request of the many-clients test in one server and not the other.
        '[tenants.default]\nclass = "batch"\n\n'
        f'[tenants.parity]\nclass = "batch"\napi_keys = ["{hash_key(KEY)}"]\n\n'
        # A bucket that refills in hours: its third request and on are 429s, all alike.
        f'[tenants.slow]\nrps = 0.0001\nburst = 2\napi_keys = ["{hash_key(SLOW)}"]\n\n'
        f'[tenants.single]\nmax_concurrency = 1\napi_keys = ["{hash_key(SINGLE)}"]\n\n'
        f"[tenants.revocable]\napi_keys = {keys}\n"
    )


def _make_numbers_echo(path: Path) -> Path:
    """in_<TYPE> -> out_<TYPE> for every numeric datatype, any shape of rank 2 (tests'
    echo model also takes BYTES, which a front never decodes)."""
    inputs, outputs, nodes = [], [], []
    for name in NUMBERS:
        inputs.append(helper.make_tensor_value_info(f"in_{name}", ECHO_TYPES[name], ["a", "b"]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", ECHO_TYPES[name], ["a", "b"]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    graph = helper.make_graph(nodes, "numbers", inputs, outputs)
    return _save(helper.make_model(graph, opset_imports=OPSET), path)


class Pair(NamedTuple):
    one: ServerProcess  # one process
    split: ServerProcess  # the engine behind a front
    folder: Path
    gates: Path


def _start(server: ServerProcess, fronts: int) -> ServerProcess:
    logged = server.log.stat().st_size if server.log.exists() else 0
    server.start()
    if fronts:  # ready comes from the front; the engine says when every front listens
        wait_until(lambda: b"front processes)" in server.log.read_bytes()[logged:], 60, "fronts")
    return server


@contextmanager
def running_pair(folder: Path) -> Iterator[Pair]:
    """The same models in one process and behind one front (one, so that the requests of
    one connection and the next all meet the same front's memory of keys: what it decodes
    is then known; two fronts answer alike, test_fronts.py)."""
    models, gates = folder / "models", folder / "gates"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    make_mlp(models / "mlp" / "2" / "model.onnx", offset=1.0)
    _make_numbers_echo(models / "numbers" / "1" / "model.onnx")
    make_simple(models / "simple" / "1" / "model.onnx")
    (models / "simple" / "labels.txt").write_text("\n".join(f"label{i}" for i in range(16)))
    make_simple_string(models / "simple_string" / "1" / "model.onnx")
    make_scripted(models / "held" / "1" / "model.scripted", ("hold",), gate_dir=gates)
    servers = []
    for fronts in (0, 1):
        profile = folder / f"profile-{fronts}.toml"
        profile.write_text(_profile(fronts))
        servers.append(ServerProcess(models, profile, folder / f"server-{fronts}.log"))
    try:
        with ThreadPoolExecutor(2) as starting:  # both at once: each takes seconds of waiting
            one, split = starting.map(_start, servers, (0, 1))
        yield Pair(one, split, folder, gates)
    finally:
        for server in servers:
            server.stop()


# -- raw HTTP: the bytes as sent and as answered ------------------------------------------


def raw_request(
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    http: str = "1.1",
) -> bytes:
    lines = [f"{method} {path} HTTP/{http}", "Host: gateway", f"X-Request-ID: {ID}"]
    given = dict(headers or {})
    named = {k.lower() for k in given}
    if body is not None and not {"content-length", "transfer-encoding"} & named:
        given["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in given.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def infer_request(
    body: bytes,
    model: str = "mlp",
    key: str | None = KEY,
    version: str | None = None,
    **headers: str,
) -> bytes:
    path = f"/v2/models/{model}" + ("" if version is None else f"/versions/{version}") + "/infer"
    given = {k.replace("_", "-"): v for k, v in headers.items()}
    if key is not None:
        given["X-API-Key"] = key
    return raw_request("POST", path, body, given)


def _one_answer(data: bytes) -> tuple[bytes, bytes] | None:
    """The first whole answer in `data` (its raw bytes) and what follows, or None."""
    head, found, rest = data.partition(b"\r\n\r\n")
    if not found:
        return None
    fields = head.lower().split(b"\r\n")
    if fields[0].split()[1].startswith(b"1"):  # 100 Continue: a head alone
        return head + found, rest
    length = next((int(f.split(b":")[1]) for f in fields if f.startswith(b"content-length:")), 0)
    if len(rest) < length:
        return None
    return head + found + rest[:length], rest[length:]


def read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` answers as the server wrote them (the Date's value blanked), fewer if it
    closes the connection first."""
    sock.settimeout(30)
    got: list[bytes] = []
    data = b""
    while len(got) < count:
        cut = _one_answer(data)
        if cut is not None:
            got.append(re.sub(rb"\r\ndate: [^\r]*", b"\r\ndate: -", cut[0]))
            data = cut[1]
            continue
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return got


def exchange(port: int, data: bytes, count: int = 1) -> list[bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return read_answers(sock, count)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


# -- bodies the corpus (test_fronts_parity_corpus.py) and the other tests share -----------


def json_body(doc: Any) -> bytes:
    return orjson.dumps(doc)


X = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
GOOD = json_body({"inputs": [X]})


def numbers_inputs(rows: int = 1, **change: Any) -> list[dict[str, Any]]:
    """One input of each numeric datatype for the numbers model, `change[TYPE]` replacing
    fields of that one."""
    inputs = []
    for t in NUMBERS:
        data: list[Any] = [True, False] * rows if t == "BOOL" else [1, 0] * rows
        if t.startswith("FP"):
            data = [0.1, -2.5] * rows
        tensor = {"name": f"in_{t}", "datatype": t, "shape": [rows, 2], "data": data}
        tensor.update(change.get(t, {}))
        inputs.append(tensor)
    return inputs


# Paths served once (a 200) before the corpus (conftest's `warm`), so that a front decodes
# the corpus's requests on them itself (server/front.py): the corpus meets both the
# front's decoding and the engine's.
WARM = [
    infer_request(GOOD),
    infer_request(GOOD, key=None),
    infer_request(GOOD, version="2"),
    infer_request(GOOD, version="02"),
    infer_request(GOOD, version=""),
    infer_request(json_body({"inputs": numbers_inputs()}), "numbers"),
    infer_request(
        json_body(
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                    {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                ]
            }
        ),
        "simple",
    ),
]


def warm_up(pair: Pair) -> Pair:
    """`pair` once each WARM request has been served in both gateways."""
    for server in (pair.one, pair.split):
        for request in WARM:
            (answer,) = exchange(server.port, request)
            assert status_of(answer) == 200, answer
    return pair
