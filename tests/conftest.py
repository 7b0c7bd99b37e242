from __future__ import annotations

import gc
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from infergate.engine.runtimes import PLUGINS_ENV
from tests import cpu_usage
from tests.cluster_setup import running_redis
from tests.leftovers import no_leftover_processes  # noqa: F401  (autouse, for serial tests)
from tests.onnx_models import make_echo, make_mlp
from tests.redis_server import RedisProcess
from tests.scripted_runtime import make_scripted, scripted_inputs
from tests.server import ServerProcess

if TYPE_CHECKING:
    from tests.fake_servers import FakeServer
    from tests.fronts_parity import Pair

REPO = Path(__file__).resolve().parent.parent


def _cache_bytecode() -> None:
    """Let this run write Python's bytecode caches, even where the environment says not to
    (container images often set PYTHONDONTWRITEBYTECODE). The suite starts about a hundred
    Python processes from this checkout (servers, CLI commands, pytest-xdist workers), and
    without the caches each compiles the infergate modules it imports, and each pytest
    process rewrites and compiles every test module again (1.1 s of CPU each). Test modules
    are imported after this file; the servers and CLI commands the tests start inherit the
    environment, and write the caches of the infergate modules the first time."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


_cache_bytecode()

# The scripted runtime (tests/scripted_runtime.py) exists in this process, in the servers
# the tests start and in their workers, and nowhere else.
os.environ[PLUGINS_ENV] = "tests.scripted_runtime"


def _share_tls_contexts() -> None:
    """httpx.get() and friends build a client per call, and each client loads a CA bundle
    (certifi's, or the one SSL_CERT_FILE names: this machine sets it to the system's) into a
    new SSL context: 25-42 ms of CPU, for URLs that are all plain http here. The tests make
    thousands of such calls (polling a starting server took more CPU than the server
    itself), so clients that trust the same bundle share one context, made once; an
    SSLContext may be shared. A test that trusts a CA of its own names it in SSL_CERT_FILE,
    as a user would, and gets a context of its own. (Keyed on SSL_CERT_FILE's absence
    alone, the sharing stopped wherever it is set: 7 of test_cli_hostile.py's 17 s.)"""
    from httpx._transports import default

    make = default.create_ssl_context  # type: ignore[attr-defined]
    shared: dict[tuple[str | None, str | None], Any] = {}

    def create(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None or not trust_env:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        trusted = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if trusted not in shared:
            shared[trusted] = make()
        return shared[trusted]

    default.create_ssl_context = create  # type: ignore[attr-defined]


_share_tls_contexts()


def write_profile(folder: Path, text: str = "") -> Path:
    path = folder / "profile.toml"
    text = text or "[server]\nmax_request_mb = 1\n"
    path.write_text(text)
    return path


def build_repository(root: Path) -> Path:
    """The models most server tests share. Not the TorchScript `encoder`: its worker costs
    2 s of CPU in every xdist worker's shared server, and one test serves it (test_v2_api)."""
    models = root / "models"
    make_mlp(models / "mlp" / "1" / "model.onnx", offset=0.0)
    make_mlp(models / "mlp" / "2" / "model.onnx", offset=100.0)
    (models / "mlp" / "model.toml").write_text("[version_policy]\nall = true\n")
    make_echo(models / "echo" / "1" / "model.onnx")
    make_mlp(models / "lone.onnx", seed=3)
    (models / "broken" / "1").mkdir(parents=True)
    (models / "broken" / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    shutil.copytree(REPO / "models" / "digits", models / "digits")
    return models


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="session")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The repository's models, shared by the files of SERVER_FILES (below: one xdist
    worker runs them all, so one starts this server); a file that uses it goes there."""
    folder = tmp_path_factory.mktemp("server")
    proc = ServerProcess(repository, write_profile(folder), folder / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server of Triton-like models (tests/triton_models.py), with the default
    profile's batching, for every Triton test file. Defined here, once: a session fixture
    that test modules import is defined once per module, and each module got a server of
    its own, kept to the end of the session."""
    from tests.triton_models import build_triton_repository

    folder = tmp_path_factory.mktemp("triton")
    models = build_triton_repository(folder)
    proc = ServerProcess(models, write_profile(folder), folder / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def parity_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """The fronts-parity pair (tests/fronts_parity.py): the same models in one process and
    behind a front, each WARM path served once in both. Shared by PARITY_FILES (below: one
    xdist worker runs them, so one starts this pair, as one file did)."""
    from tests.fronts_parity import running_pair, warm_up

    with running_pair(tmp_path_factory.mktemp("parity")) as pair:
        yield warm_up(pair)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A real redis-server of the test's own on a loopback port (the cluster tests)."""
    with running_redis(tmp_path / "redis") as process:
        yield process


BAD_REQUEST = scripted_inputs(fail=1)  # for the breaker_server's flaky model

BREAKER_PROFILE = """
[server]
file_stable_s = 0.2
[breaker]
window_seconds = 2
failure_rate = 0.5
min_requests = 4
consecutive_windows = 2
backoff_initial_s = 30
"""


def breaker_server_in(folder: Path) -> ServerProcess:
    """Two scripted models, mlp (x [-1, 4] in, y out) and flaky (fails when its `fail`
    input is 1: BAD_REQUEST), behind a breaker that opens within a second of failures and
    stays open for 30 s: not started yet."""
    models = folder / "models"
    make_scripted(models / "mlp" / "1" / "model.scripted", ())
    make_scripted(models / "flaky" / "1" / "model.scripted", ("fail",))
    return ServerProcess(models, write_profile(folder, BREAKER_PROFILE), folder / "server.log")


@pytest.fixture
def breaker_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of its own (breaker_server_in) for each test."""
    proc = breaker_server_in(tmp_path)
    yield proc.start()
    proc.stop()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(cpu_usage.ENV) == "1":
        config.pluginmanager.register(cpu_usage.CpuUsage(), "infergate-cpu-usage")


def _parallel(config: pytest.Config) -> bool:
    """An xdist run: this is one of its workers, or the controller of some."""
    return hasattr(config, "workerinput") or bool(getattr(config.option, "numprocesses", None))


# Files that share one session server and nothing else needs: one xdist worker runs each
# group (one work unit), so one worker starts that server, not each of the four.
SERVER_FILES = (  # conftest's `server`: 2.5 s of CPU a start (five ONNX model workers)
    "test_dashboard.py",
    "test_v2_api.py",
    "test_observability.py",
    "test_cli.py",
    "test_ops_readme.py",
    "test_bad_inputs.py",
    "test_http_protocol.py",
    "test_edge_body_framing.py",
)
TRITON_FILES = (  # conftest's `triton_server`
    "test_triton_config.py",
    "test_triton_readiness.py",
    "test_triton_responses.py",
    "test_triton_shm.py",
    "test_triton_stats.py",
    "test_triton_strings.py",
)
PARITY_FILES = (  # conftest's `warm`; the corpus first: the tenants' file checks, last,
    "test_fronts_parity_corpus.py",  # that neither gateway holds a slot after both files
    "test_fronts_parity_tenants.py",
)
ONE_WORKER = {
    **dict.fromkeys(SERVER_FILES, "server"),
    **dict.fromkeys(TRITON_FILES, "triton_server"),
    **dict.fromkeys(PARITY_FILES, "warm"),
}


# The files that take longest (several servers each, and waits for breakers, restarts,
# drains and watchers), longest first, by the wall seconds of a parallel run
# (INFERGATE_TEST_CPU=1 prints them). pytest-xdist's loadscope hands out whole files in
# collection order (pytest_xdist_make_scheduler below): one of these handed out last would
# run alone at the end while the other workers sit idle.
LONGEST_FIRST = (  # by their wall seconds in full parallel runs (INFERGATE_TEST_CPU=1)
    *SERVER_FILES,  # one unit of work, the longest: the dashboard alone is the longest file
    "test_edge_drain.py",
    "test_fork_server.py",
    "test_cli_unix.py",
    "test_cluster_outage.py",
    "test_devices.py",
    "test_reload.py",
    "test_tenant_isolation.py",
    "test_cluster_limits.py",
    "test_tenants.py",
    "test_edge_connections.py",
    "test_models_faults.py",
    "test_bench.py",
    "test_cli_top_hostile.py",
    "test_ops_examples.py",
    "test_models_profile.py",
    "test_models_watcher.py",
    *TRITON_FILES,  # one unit of work: the six take about as long as that together
    "test_remote.py",
    "test_cli_hostile.py",
    *PARITY_FILES,  # one unit of work, as the one file they were
    "test_private_models.py",
    "test_start_imports.py",
    "test_fronts.py",
    "test_large_answers.py",
    "test_choose_python.py",
    "test_edge_requests.py",
    "test_edge_decoding.py",
    "test_repository_api.py",
    "test_cluster_drain.py",
    "test_workers.py",
    "test_engine_hardening.py",
    "test_models_verified_store.py",
    "test_ops_server.py",
    "test_infer_lane.py",
    "test_triton_perf_analyzer.py",
    "test_models_warmup.py",
    "test_queue_properties.py",
    "test_scheduler.py",
    "test_bench_triton_peer.py",
    "test_sequences_triton.py",
    "test_tenant_allow_list.py",
    "test_scripted_runtime.py",
    "test_gateway.py",
    "test_edge_admin.py",
    "test_remote_imports.py",
    "test_runtime_missing.py",
    "test_kubernetes_manifests.py",
    "test_engine_cancel.py",
    "test_bench_hostile.py",
    "test_worker_outputs.py",
    "test_timing_rules.py",
    "test_timing_rules_engine.py",
    "test_sequences.py",
    "test_tenant_isolation_rules.py",
    "test_breaker_tenants.py",
    "test_errors_tree.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """loadscope, a file a scope and each ONE_WORKER group one, the scopes handed out in
    collection order (LONGEST_FIRST): xdist's default reorders them by their number of
    tests, which hands out a long file of few tests last."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Scopes(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            # The file, whatever its test ids hold: xdist's own splits at the last "::",
            # and test_ops_server's [::1-json-[::1]] went to a worker of its own.
            path = nodeid.split("::", 1)[0]
            return ONE_WORKER.get(path.rsplit("/", 1)[-1], path)

    config.option.loadscopereorder = False
    return Scopes(config, log)


def _file_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (see LONGEST_FIRST; a stable sort keeps each file's own
    order). A parallel run (-n N) leaves out the tests marked `serial`: they measure
    latency against a wall clock, which other workers' servers would skew. The README's
    test command runs them in a second pass of their own (`pytest -m serial`)."""
    items.sort(key=_file_rank)
    if not _parallel(config):
        return
    serial = [item for item in items if item.get_closest_marker("serial")]
    if serial:
        config.hook.pytest_deselected(items=serial)
        items[:] = [item for item in items if not item.get_closest_marker("serial")]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The serial pass (`pytest -m serial`) imports only the test files that can hold a
    test marked serial: one whose text never says `serial` has none, and importing the
    other seventy files (and what they import) took a few seconds of that pass."""
    if config.getoption("markexpr") != "serial" or _parallel(config):
        return None
    name = collection_path.name
    if collection_path.suffix == ".py" and name.startswith("test_"):
        return b"serial" not in collection_path.read_bytes() or None
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection built (every test module and what it imports: hundreds of
    thousands of objects) lives to the end of the run: out of the cyclic collector's
    walks (gc.freeze), as cli/serve.py's _tune_gc does for the gateway. Each full walk of
    a pytest process took 0.1 to 0.3 s, and the Textual tests make one every few seconds;
    what the tests themselves allocate is collected as before."""
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    if _parallel(config):
        terminalreporter.write_line(
            "tests marked serial were left out of this parallel run: run `pytest -m serial`"
        )


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    """The hostile-server tests' fake server (tests/fake_servers.py), answering nothing
    until a test sets its routes."""
    from tests.fake_servers import FakeServer

    with FakeServer() as server:
        yield server


@pytest.fixture
def model_server(fake: FakeServer) -> FakeServer:
    """`fake` serving model `m` as infergate would (its metadata, its inferences)."""
    return fake.serve_model()
