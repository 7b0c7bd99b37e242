"""The admin surface (issue 12): model names in the repository API are names, not paths; a
web page in the operator's browser cannot drive the keyless (loopback) admin API, while
tritonclient and the CLI still can; and limits are opt-in, so a fresh gateway has none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.http as triton_http

from infergate.engine.admission.tenants import NO_CONCURRENCY_LIMIT, NO_RATE_LIMIT
from infergate.profile import load_profile
from tests.edge_raw import connect, head, read_reply
from tests.onnx_models import make_mlp
from tests.server import ServerProcess

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("admin")
    models = folder / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx")
    profile = folder / "profile.toml"
    profile.write_text("[server]\nmodel_control = 'explicit'\n")
    proc = ServerProcess(models, profile, folder / "server.log").start()
    yield proc
    proc.stop()


@pytest.mark.parametrize("name", ["..", "%2E%2E", ".hidden", ".", "mlp%0A"])
@pytest.mark.parametrize("action", ["load", "unload"])
def test_a_model_name_that_is_a_path_is_a_400(
    admin_server: ServerProcess, name: str, action: str
) -> None:
    with connect(admin_server.port) as sock:  # raw: an HTTP library would resolve ".."
        path = f"/v2/repository/models/{name}/{action}"
        sock.sendall(head("POST", path, admin_server.port, {"Content-Length": "0"}))
        reply = read_reply(sock)
    assert reply is not None
    assert reply.status == 400, reply.body
    assert "is not a model name" in str(reply.json()["error"])
    index = httpx.post(f"{admin_server.url}/v2/repository/index").json()
    assert [row["name"] for row in index] == ["mlp"]


FORM_TYPES = [
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
]


@pytest.mark.parametrize("content_type", FORM_TYPES)
def test_a_body_a_form_can_send_cannot_change_state(
    admin_server: ServerProcess, content_type: str
) -> None:
    # What such a form sends: fields, never a JSON object (a form percent-encodes "{").
    body = b'{"a": "=b"}' if content_type.startswith("text/plain") else b"model=mlp"
    r = httpx.post(
        f"{admin_server.url}/v2/repository/models/mlp/unload",
        content=body,
        headers={"Content-Type": content_type},
    )
    assert r.status_code == 403
    assert "HTML form" in r.json()["error"]
    assert httpx.get(f"{admin_server.url}/v2/models/mlp/ready").status_code == 200


def test_a_json_object_labelled_form_encoded_is_not_a_form(admin_server: ServerProcess) -> None:
    # libcurl (perf_analyzer) labels every POST body form-encoded unless told otherwise.
    r = httpx.post(
        f"{admin_server.url}/v2/repository/index",
        content=b"{}",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1"])
def test_another_sites_page_cannot_change_state(admin_server: ServerProcess, origin: str) -> None:
    r = httpx.post(
        f"{admin_server.url}/v2/repository/models/mlp/unload",
        headers={"Origin": origin, "Content-Type": "application/json"},
    )
    assert r.status_code == 403
    assert "another site's page" in r.json()["error"]
    assert httpx.get(f"{admin_server.url}/v2/models/mlp/ready").status_code == 200
    # Reading stays open (a page cannot read the answer without CORS anyway).
    assert httpx.get(f"{admin_server.url}/admin/models", headers={"Origin": origin}).is_success


def test_tritonclient_and_same_origin_json_still_drive_the_repository(
    admin_server: ServerProcess,
) -> None:
    client = triton_http.InferenceServerClient(f"127.0.0.1:{admin_server.port}")
    assert [m["name"] for m in client.get_model_repository_index()] == ["mlp"]
    client.unload_model("mlp")
    assert not client.is_model_ready("mlp")
    client.load_model("mlp")
    assert client.is_model_ready("mlp")
    same_origin = {"Origin": admin_server.url, "Content-Type": "application/json"}
    r = httpx.post(f"{admin_server.url}/v2/repository/models/mlp/load", headers=same_origin)
    assert r.status_code == 200, r.text


def test_a_fresh_gateway_has_no_rate_or_concurrency_limit(admin_server: ServerProcess) -> None:
    (default,) = load_profile(REPO / "profiles" / "default.toml").tenants
    assert default.rps == NO_RATE_LIMIT
    assert default.max_concurrency == NO_CONCURRENCY_LIMIT
    tenants = httpx.get(f"{admin_server.url}/admin/tenants").json()["tenants"]
    (anonymous,) = [t for t in tenants if t["name"] == "default"]
    assert anonymous["rps"] is None
    assert anonymous["burst"] is None
    assert anonymous["max_concurrency"] is None


def test_a_tenant_that_sets_rps_alone_gets_a_burst_of_two_seconds(tmp_path: Path) -> None:
    profile = tmp_path / "profile.toml"
    profile.write_text("[tenants.default]\nrps = 50\n[tenants.team]\nmax_concurrency = 4\n")
    by_name = {t.name: t for t in load_profile(profile).tenants}
    assert by_name["default"].burst == 100
    assert by_name["team"].max_concurrency == 4
    assert by_name["team"].rps == float("inf")


def test_an_empty_form_body_drops_shm_registrations_at_most(admin_server: ServerProcess) -> None:
    # perf_analyzer unregisters with an empty body that libcurl labels form-encoded; the
    # same body on any other route is still what a form sends.
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    shm = httpx.post(f"{admin_server.url}/v2/systemsharedmemory/unregister", headers=form)
    assert shm.status_code == 200, shm.text
    unload = httpx.post(f"{admin_server.url}/v2/repository/models/mlp/unload", headers=form)
    assert unload.status_code == 403
    assert httpx.get(f"{admin_server.url}/v2/models/mlp/ready").status_code == 200


@pytest.mark.parametrize("replay", ["ten", "-2", "1.0", "\u0661"])
def test_a_replay_that_is_not_a_whole_number_is_a_400_naming_it(
    admin_server: ServerProcess, replay: str
) -> None:
    answer = httpx.get(f"{admin_server.url}/admin/events", params={"replay": replay}, timeout=10)
    assert answer.status_code == 400
    assert answer.json()["error"] == (
        f"replay must be a whole number (0 or more) of past events to send first, not {replay!r}"
    )


def test_a_version_or_region_in_the_query_is_read_as_in_the_path(
    admin_server: ServerProcess,
) -> None:
    """Where a route's path has no place for it, the version or region comes from the
    query, as the routes read it before they moved off FastAPI: `?region=a` unregisters
    region a, not every region."""
    url = admin_server.url
    assert httpx.get(f"{url}/v2/models/mlp/ready?version=1", timeout=10).status_code == 200
    missing = httpx.get(f"{url}/v2/models/mlp/ready?version=7", timeout=10)
    assert missing.status_code == 404, missing.text
    assert httpx.get(f"{url}/v2/models/mlp?version=abc", timeout=10).status_code == 400
    key = f"/infergate-test-{admin_server.port}"
    shm = Path("/dev/shm") / key.lstrip("/")
    shm.write_bytes(b"\0" * 64)
    try:
        for region in ("a", "b"):
            body = {"key": key, "offset": 0, "byte_size": 64}
            r = httpx.post(f"{url}/v2/systemsharedmemory/region/{region}/register", json=body)
            assert r.status_code == 200, r.text
        assert httpx.post(f"{url}/v2/systemsharedmemory/unregister?region=a").status_code == 200
        left = httpx.get(f"{url}/v2/systemsharedmemory/status", timeout=10).json()
        assert [r["name"] for r in left] == ["b"]
        one = httpx.get(f"{url}/v2/systemsharedmemory/status?region=a", timeout=10)
        assert one.status_code == 400
    finally:
        httpx.post(f"{url}/v2/systemsharedmemory/unregister")
        shm.unlink()


def test_a_405_says_which_methods_the_path_takes(admin_server: ServerProcess) -> None:
    answer = httpx.delete(f"{admin_server.url}/v2/health/live", timeout=10)
    assert answer.status_code == 405
    assert answer.json()["error"] == "DELETE is not allowed on /v2/health/live"
    assert answer.headers["allow"] == "GET, HEAD"
    # The infer route too (it answered 404 "no such endpoint", without Allow).
    for method in ("GET", "PUT", "DELETE"):
        for path in ("/v2/models/m/infer", "/v2/models/m/versions/1/infer"):
            answer = httpx.request(method, f"{admin_server.url}{path}", timeout=10)
            assert answer.status_code == 405
            assert answer.json()["error"] == f"{method} is not allowed on {path}"
            assert answer.headers["allow"] == "POST"


def test_head_on_the_event_stream_is_its_headers_alone(admin_server: ServerProcess) -> None:
    with connect(admin_server.port) as sock:  # the next request on it is still answered
        sock.sendall(
            head("HEAD", "/admin/events", admin_server.port)
            + head("GET", "/v2/health/live", admin_server.port)
        )
        data = b""
        while b'{"live":true}' not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    first, _, second = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in first
    assert second.startswith(b"HTTP/1.1 200")


def test_a_get_route_answers_head_with_its_headers_and_no_body(
    admin_server: ServerProcess,
) -> None:
    """As HTTP asks of a server's GET resources (RFC 9110, 9.3.2): a load balancer's HEAD
    health check gets the status a GET would, not a 405."""
    with connect(admin_server.port) as sock:  # raw: both answers on one connection
        sock.sendall(
            head("HEAD", "/v2/health/live", admin_server.port)
            + head("GET", "/v2/health/live", admin_server.port)
        )
        data = b""
        while data.count(b'{"live":true}') < 1:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    first, _, second = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200")
    assert b"content-type: application/json" in first.lower()
    assert second.startswith(b"HTTP/1.1 200")  # no body came between the two heads
    assert second.endswith(b'{"live":true}')
    refused = httpx.head(f"{admin_server.url}/v2/repository/index", timeout=10)
    assert refused.status_code == 405  # a POST route stays POST only
