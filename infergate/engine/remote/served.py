"""RemoteServedVersion: a served version whose model runs on other V2 servers.

It is a ServedVersion without workers: the same breaker, stats, drain and state, so
tenants, limits, classes, deadlines and breakers apply as to a local model. Loading it
asks each endpoint for the remote model's metadata and readiness; the tensors it reports
are checked like a local file's (against model.toml's inputs/outputs when declared) and
must agree across endpoints. Then a loop checks /v2/health/ready on every endpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Hashable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from infergate.engine.context import EngineContext
from infergate.engine.lifecycle.served import ServedVersion
from infergate.engine.remote.client import RemotePool, UpstreamReply, answered
from infergate.engine.remote.config import RemoteConfig
from infergate.engine.remote.http1 import Payload
from infergate.engine.remote.metrics import remote_metrics
from infergate.engine.remote.slots import Turn
from infergate.engine.repository.spec import ModelEntry, ModelVersionFile, TensorSpec
from infergate.engine.repository.verify import VerificationFailed, VerifyPolicy, check_digest
from infergate.engine.scheduling.classes import PriorityClass
from infergate.engine.scheduling.queue import Fairness
from infergate.engine.scheduling.tickets import Answer, Timing
from infergate.errors import (
    ConfigError,
    ControlFailed,
    InfergateError,
    MetadataError,
    ModelExecutionError,
)
from infergate.settings.table import read_toml
from infergate.tensors import V2_TO_NUMPY, Array

log = logging.getLogger("infergate.remote")
# How long a load asks again while no endpoint answers at all (an upstream starting with
# the gateway): the load holds the gateway's readiness and the model's other changes.
LOAD_RETRY_S = 10.0
REMOTE = "remote"


def verified_config(path: Path, scanned_sha256: str | None, policy: VerifyPolicy) -> str:
    """The SHA256 of the model.toml at `path` that names a remote model, once its bytes
    passed a model file's checks (the endpoints it names are what serves: with signed
    models required, it must be signed as a model file is) and are the bytes the scan
    parsed, `scanned_sha256` (else it changed since: it is read again)."""
    try:
        sha = hashlib.sha256(read_toml(path)).hexdigest()
    except ConfigError as exc:
        raise VerificationFailed(str(exc)) from None
    check_digest(path, sha, None, policy)
    if sha != scanned_sha256:
        raise VerificationFailed(f"{path} changed while it was verified; it is read again")
    return sha


def _tensors(doc: dict[str, Any], kind: str) -> tuple[TensorSpec, ...]:
    out = []
    for item in doc.get(kind) or []:
        try:
            name, datatype, shape = item["name"], item["datatype"], item["shape"]
        except (KeyError, TypeError):
            raise MetadataError(
                f"its {kind} entry {item!r} lacks name, datatype or shape"
            ) from None
        if datatype not in V2_TO_NUMPY:
            raise MetadataError(f"its {kind} {name!r} has datatype {datatype!r}, not a V2 type")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in shape
        ):
            raise MetadataError(f"its {kind} {name!r} has shape {shape!r}")
        out.append(TensorSpec(str(name), datatype, tuple(shape)))
    return tuple(out)


class _NoAnswer(str):
    """Why an endpoint does not serve the model yet: it did not answer at all (refused, or
    no answer in time), or answered 503 (up, still loading its models)."""


# An endpoint's tensors and platform, or why not.
_Described = tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], str] | str


def _show(specs: tuple[TensorSpec, ...]) -> str:
    return ", ".join(f"{s.name} {s.datatype} {list(s.shape)}" for s in specs) or "none"


class RemoteServedVersion(ServedVersion):
    def __init__(
        self, entry: ModelEntry, file: ModelVersionFile, sha256: str, context: EngineContext
    ) -> None:
        super().__init__(entry, file, sha256, context)
        remote = entry.config.remote
        assert remote is not None  # the repository scan made a remote version of it
        self.remote: RemoteConfig = remote
        self.instances = []  # no workers: it runs elsewhere
        self.unavailable = None
        self.remote_model = remote.model or entry.name
        base = f"/v2/models/{quote(self.remote_model, safe='')}"
        self.model_path = base + (f"/versions/{remote.version}" if remote.version else "")
        self.infer_path = self.model_path + "/infer"
        self.pool = RemotePool(
            remote,
            context.clock,
            self._event,
            metrics=remote_metrics(context.metrics),
            model=entry.name,
        )
        self._state = "loading"
        self._why: str | None = None
        self._inputs: tuple[TensorSpec, ...] = ()
        self._outputs: tuple[TensorSpec, ...] = ()
        self._tasks: list[asyncio.Task[None]] = []

    def _event(self, kind: str, text: str) -> None:
        self._context.events.publish(kind, self.name, text, self.version)

    # -- loading and state ---------------------------------------------------------------

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._load(), name=f"remote-load:{self.name}"))

    async def wait_settled(self) -> None:
        await asyncio.gather(*self._tasks[:1], return_exceptions=True)

    async def _load(self) -> None:
        found = await self._described()
        good = {e: r for e, r in found.items() if not isinstance(r, str)}
        for endpoint, result in found.items():
            if isinstance(result, str):  # out until its health checks pass
                for _ in range(self.remote.unhealthy_threshold):
                    self.pool.health.record(endpoint, False, result)
        if not good:
            why = "; ".join(f"{e}: {r}" for e, r in found.items())
            self._fail(f"no endpoint serves {self.remote_model!r}: {why}")
            return
        first_endpoint, (inputs, outputs, platform) = next(iter(good.items()))
        for endpoint, (i, o, _) in good.items():
            if (i, o) != (inputs, outputs):
                self._fail(
                    f"endpoints disagree on the model's tensors: {first_endpoint} has inputs "
                    f"({_show(inputs)}) outputs ({_show(outputs)}), {endpoint} has inputs "
                    f"({_show(i)}) outputs ({_show(o)}). Hint: serve the same model version "
                    "on every endpoint, or pin [remote] version"
                )
                return
        for kind, declared, found_specs in (
            ("inputs", self.config.inputs, inputs),
            ("outputs", self.config.outputs, outputs),
        ):
            if declared and declared != found_specs:
                self._fail(
                    f"the remote model's {kind} ({_show(found_specs)}) differ from "
                    f"model.toml's ({_show(declared)})"
                )
                return
        self._inputs, self._outputs, self.platform = inputs, outputs, platform
        self._state = "ready"
        self._tasks.append(asyncio.create_task(self._check_loop(), name=f"remote:{self.name}"))

    async def _described(self) -> dict[str, _Described]:
        """What each endpoint says of the model. While none answers at all (refused, or
        no answer in time) or but with a 503 (still loading its models), the upstream
        may be starting beside the gateway (compose, Kubernetes): each is asked again,
        after 1 s, then 2 and 4, for at most LOAD_RETRY_S (the load holds the gateway's
        readiness and the model's reloads). A 503 failed the model at once."""
        loop, delay = asyncio.get_running_loop(), 1.0
        started = loop.time()
        while True:
            results = await asyncio.gather(*(self._describe(e) for e in self.remote.endpoints))
            found = dict(zip(self.remote.endpoints, results, strict=True))
            if not all(isinstance(r, _NoAnswer) for r in found.values()):
                break
            if loop.time() - started + delay > min(LOAD_RETRY_S, self._context.load_timeout_s):
                break
            why = "; ".join(f"{e}: {r}" for e, r in found.items())
            self._why = f"no endpoint serves it yet; asking again in {delay:.0f} s: {why}"
            await asyncio.sleep(delay)
            delay *= 2
        self._why = None
        return found

    def _fail(self, why: str) -> None:
        self._state, self._why = "failed", why

    async def _describe(self, endpoint: str) -> _Described:
        """The remote model's tensors and platform on `endpoint`, or why not (_NoAnswer
        when it did not answer at all)."""
        # At most half the load's retry time a request: a health_timeout_s of an hour
        # held the gateway's readiness past 75 s (a round asks twice).
        timeout = min(max(self.remote.health_timeout_s, 5.0), LOAD_RETRY_S / 2)
        try:
            meta = await self.pool.get(endpoint, self.model_path, timeout)
            if meta.status != 200:
                text = meta.body[:200].decode(errors="replace")
                said = f"{self.model_path} answered {meta.status}: {text}"
                return _NoAnswer(said) if meta.status == 503 else said
            ready = await self.pool.get(endpoint, self.model_path + "/ready", timeout)
            if ready.status != 200:
                said = f"{self.model_path}/ready answered {ready.status} (not ready)"
                return _NoAnswer(said) if ready.status == 503 else said
            doc = orjson.loads(meta.body)
            if not isinstance(doc, dict):
                raise MetadataError("it is not a JSON object")
            return _tensors(doc, "inputs"), _tensors(doc, "outputs"), str(doc.get("platform", ""))
        except ControlFailed as exc:
            return _NoAnswer(exc)
        except (MetadataError, ValueError) as exc:
            return f"its metadata at {self.model_path} is not V2 metadata: {exc}"

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.remote.health_interval_s)
            try:
                await self.pool.check_health()
            except Exception:  # a bug here must not end the checks
                log.exception("health checks of %s failed", self.name)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._state != "failed":
            self._state = "stopped"
        await self.pool.close()

    @property
    def state(self) -> str:
        return self._state

    @property
    def ready(self) -> bool:
        return self._state == "ready"

    @property
    def reason(self) -> str | None:
        return self._why

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    @property
    def batchable(self) -> bool:
        return False  # the remote server batches, not us

    def upstream_status(self) -> dict[str, Any] | None:
        return {"model": self.model_path, "endpoints": self.endpoints_status()}

    def endpoints_status(self) -> list[dict[str, Any]]:
        """Each endpoint as the admin API shows it."""
        pool = self.pool
        return [
            {
                "endpoint": e,
                "healthy": pool.health.is_healthy(e),
                "ejected": pool.outliers.is_ejected(e),
                "ejections": pool.outliers.states[e].ejections,
                "in_flight": pool.balancer.active[e],
                "sent": pool.balancer.sent[e],
            }
            for e in self.remote.endpoints
        ]

    # -- requests ------------------------------------------------------------------------

    async def forward(
        self,
        body: Payload,
        headers: dict[str, str],
        start_by: float,
        finish_by: float,
        turn: Turn = (0, None),
    ) -> UpstreamReply:
        """The pass-through: `body` goes upstream unchanged, in `turn` (class rank,
        tenant) for a connection."""
        self.requests.enter()
        clock, stats = self._context.clock, self.scheduler.stats
        started = clock.now()
        try:
            reply = await self.pool.forward(
                self.infer_path, body, headers, start_by, finish_by, turn
            )
        except InfergateError:
            stats.request_failed(clock.now() - started)
            raise
        finally:
            self.requests.leave()
        took = clock.now() - started
        if reply.status == 200:
            stats.request_done(took, 0.0, took)
        else:
            stats.request_failed(took)
        return reply

    def begin(
        self,
        inputs: dict[str, Array],
        key: Hashable,
        outputs: tuple[str, ...],
        cls: PriorityClass,
        queue_deadline_s: float,
        timeout_s: float,
        session: str | None = None,
        fair: Fairness | None = None,
        instance: int | None = None,
        counted: bool = False,
    ) -> tuple[Awaitable[Answer], float]:
        """The request goes upstream (`_upstream`), not into a local queue (its answer
        is never `counted`: `forward` counts it, and `Engine.finish` records it)."""
        turn = (cls.rank, None if fair is None else fair.tenant)
        waiting = self._upstream(inputs, outputs, queue_deadline_s, timeout_s, turn)
        return waiting, self._context.clock.now()

    def end(self, started: float, answer: Answer | None, error: BaseException | None) -> None:
        """Nothing: `forward` counted the request and held its place among those in
        flight."""

    async def _upstream(
        self,
        inputs: dict[str, Array],
        outputs: tuple[str, ...],
        queue_deadline_s: float,
        timeout_s: float,
        turn: Turn,
    ) -> tuple[dict[str, Array], Timing]:
        """Decoded inputs (a request that needed decoding here, e.g. one in shared
        memory): sent upstream as binary tensors, the answer decoded back."""
        # The HTTP client's V2 codec (without the client, which imports httpx): loaded on
        # first use.
        from infergate.client_codec import decode_infer_response, encode_infer_request

        clock = self._context.clock
        body, headers = encode_infer_request(inputs, list(outputs))
        now = clock.now()
        reply = await self.forward(body, headers, now + queue_deadline_s, now + timeout_s, turn)
        took = clock.now() - now
        if reply.status != 200:
            raise answered(reply)
        length = next(
            (v for k, v in reply.headers if k == b"inference-header-content-length"), None
        )
        try:
            decoded = decode_infer_response(reply.body, None if length is None else length.decode())
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelExecutionError(
                f"upstream {reply.endpoint} sent a broken answer: {exc}"
            ) from None
        result = {n: a for n, a in decoded.outputs.items() if n in outputs}
        return result, Timing(0.0, took, took)
