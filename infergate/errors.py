"""Every exception infergate raises on purpose. The HTTP edge (server/errors.py and the
infer route) maps an InfergateError to its status code; the signals below it never reach
HTTP: the engine catches them and turns them into a state, an event or an InfergateError.

InfergateError                    500
├── BadRequest                    400  (shape, dtype, size, JSON)
│   ├── PayloadTooLarge           413
│   ├── TooLargeForQueue          400  (more chunks than the queue can ever hold)
│   └── DataNotServable           400  (the runtime cannot serve this data: raised in a worker)
├── ClientGone                    499  (the client left before its answer: logged, never sent)
├── Unauthorized                  401
├── Forbidden                     403
├── RateLimited                   429  (reason: rate, concurrency)
├── ModelNotFound                 404  (unknown model or version, or unloaded)
├── TenantNotFound                404  (the admin API names no such tenant)
├── TenantExists                  409  (the admin API adds a tenant that exists)
├── NoProfileFile                 409  (an admin change, but the server has no profile file)
├── ModelFailed                   424  (failed to load, or its runtime is missing)
├── PlacementRefused              507  (no device or quota room; the version fails with it)
├── ModelNotReady                 503  (loading, restarting: Retry-After)
├── WorkerFailed                  503  (the worker died or was killed mid-request)
│   ├── WorkerOverMemory          503  (killed past its memory limit: run again only from a batch)
│   └── SharedMemoryUnavailable   503  (the system gave no arena large enough)
├── SequenceLost                  410  (a sequence's instance died: its state is gone)
├── CircuitOpen                   503  (Retry-After)
├── Overloaded                    503  (Retry-After)
├── DeadlineExceeded              504  (the model ran past its execution timeout)
│   └── QueueDeadlineExceeded     504  (never started: waited past its deadline)
├── ModelExecutionError           500  (the runtime raised)
├── UpstreamFailed                502  (a remote model's endpoints gave no answer)
├── UpstreamAnswered              500  (by default; carries the upstream's own status)
└── ConfigError                        (a model.toml or profile is wrong; not an HTTP error)

Signals inside the engine (plain exceptions, never an HTTP answer):
  VerificationFailed   a model file may not serve (hash, signature, open); the load fails
    NoRoom             its copy would leave too little room; a sync may still hash it
  RuntimeUnavailable   a runtime's library is not installed; the version is "unavailable"
  WarmupInputError     (ValueError) model.toml's warm-up sample cannot feed the model
  WarmupFailed         the warm-up input made the model fail, in the worker
  WorkerLoadError      a worker could not load its model
  WorkerStartError     a worker process could not be started (fds, memory, processes)
  QueueFull            no room in the queue and nothing lower to shed (becomes Overloaded)
  RedisUnavailable     a call to Redis failed or ran past its socket timeout ([cluster])
  ConnectFailed        a remote endpoint's connection never opened (nothing sent: retried)
  PoolTimeout          no connection to a remote endpoint came free in time (nothing sent)
  BrokenReply          a remote endpoint's answer broke off or was not HTTP
  StaleConnection      (BrokenReply) a kept-alive connection the endpoint had closed
  ControlFailed        a remote endpoint's metadata, readiness or health call got no answer
  MetadataError        a remote model's metadata is not valid V2 metadata
  FrontFailed          a front process ([server] fronts) exited before it listened
  BrokenOff            the engine's answer to a front broke off: the connection closes

Signals inside the infer route (each is finished another way, never an HTTP answer):
  LargeAnswer          an answer too large to encode in one go: encoded in slices
  CompressLater        a body too large to compress on the loop: compressed on a thread
  TooDeep              a request the decode helper cannot hand back: decoded on the loop

Outside the server: `client.ClientError` (the HTTP client's), `client.UrlError` (a server
address that is not one: a usage mistake), `loadgen_inputs.InputsTooLarge` (bench's random
inputs past their cap), `tui.source.SourceError` (the dashboard's data source) and
`server.http_protocol._Refused` (a connection refused before it reaches the app).

`reason` is a short, stable code for metrics labels: code reads it, never the message.
`model_fault` says whether the model itself is to blame, so a breaker counts it; load,
timeouts in the queue and the gateway's own bugs are not the model's fault.
"""

from __future__ import annotations

import reprlib
from collections.abc import Hashable


class _Shown(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1000:  # past about 300 digits: not written out (Python refuses
            # to past 4,300, and a message would not show them all anyway)
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHOWN = _Shown()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxdict = 8


def shown(value: object) -> str:
    """A client's value, as an error message names it: short, and read only a few levels
    deep (the repr of JSON nested a thousand levels passes Python's recursion limit, and
    one of an integer of thousands of digits Python's int-to-str limit: either would
    turn a 400 into a 500)."""
    return _SHOWN.repr(value)


class InfergateError(Exception):
    """Base of every error the engine raises on purpose."""

    status = 500
    retry_after_s: float | None = None
    reason = "internal"
    model_fault = False
    # The tenants whose requests shared the batch that failed with it, when they were
    # several (the breaker counts it for them together); set on a copy, per batch.
    shared: frozenset[Hashable] | None = None


class BadRequest(InfergateError):
    status = 400
    reason = "bad_request"


class DataNotServable(BadRequest):
    """A request whose data the model's runtime cannot serve (onnxruntime cannot return
    a string output that is not UTF-8): raised in a worker, the request's fault, not the
    model's. A batch it breaks is run again request by request (scheduling/runner.py),
    so that only its sender gets the 400."""


class PayloadTooLarge(BadRequest):
    status = 413
    reason = "too_large"


class TooLargeForQueue(BadRequest):
    """More chunks than max_queue_size: no retry can make room for it."""

    reason = "too_large_for_queue"


class ClientGone(InfergateError):
    """The client closed its connection before its answer: nothing more is done for the
    request (server/departure.py). 499 is nginx's "client closed request": it is never
    sent (there is no one to send it to), only logged and counted."""

    status = 499
    reason = "client_gone"

    def __init__(self) -> None:
        super().__init__("the client closed its connection before its answer")


class Unauthorized(InfergateError):
    status = 401
    reason = "unauthorized"


class Forbidden(InfergateError):
    status = 403
    reason = "forbidden"


class RateLimited(InfergateError):
    status = 429
    reason = "rate"

    def __init__(self, message: str, retry_after_s: float, reason: str = "rate") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class CircuitOpen(InfergateError):
    status = 503
    reason = "breaker_open"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotFound(InfergateError):
    status = 404
    reason = "not_found"


class TenantNotFound(InfergateError):
    status = 404
    reason = "tenant_not_found"


class TenantExists(InfergateError):
    """POST /admin/tenants names a tenant that exists: its keys are not replaced."""

    status = 409
    reason = "tenant_exists"


class NoProfileFile(InfergateError):
    """The server runs without a profile file, so an admin change has nowhere to persist."""

    status = 409


class PlacementRefused(InfergateError):
    """No device the tenant may use has room, or its memory quota is spent."""

    status = 507


class ModelFailed(InfergateError):
    """No version can serve and none is on its way (failed to load, runtime missing):
    424 Failed Dependency, without Retry-After, as only a person can fix it. Not 409:
    proxies retry that (Envoy's retriable-4xx)."""

    status = 424
    reason = "failed"


class ModelNotReady(InfergateError):
    status = 503
    retry_after_s = 1.0
    reason = "not_ready"


class WorkerFailed(InfergateError):
    status = 503
    retry_after_s = 1.0
    reason = "worker_failed"
    model_fault = True


class WorkerOverMemory(WorkerFailed):
    """The worker was killed for using more than its memory limit (a lone request is not run
    again; a batch's requests run again alone, once)."""


class SequenceLost(InfergateError):
    """A sequence's instance died after it started: its state went with it. No retry of
    this request can help; the client starts the sequence again."""

    status = 410
    reason = "sequence_lost"


class SharedMemoryUnavailable(WorkerFailed):
    """A request's tensors need a larger arena and the system would not give one (503)."""


class Overloaded(InfergateError):
    status = 503
    retry_after_s = 1.0
    reason = "overloaded"


class DeadlineExceeded(InfergateError):
    status = 504
    reason = "execution_timeout"
    model_fault = True


class QueueDeadlineExceeded(DeadlineExceeded):
    """It waited in the queue past its deadline and never ran: load, not the model."""

    reason = "deadline"
    model_fault = False


class ModelExecutionError(InfergateError):
    status = 500
    reason = "execution_failed"
    model_fault = True


class UpstreamFailed(InfergateError):
    """No endpoint of a remote model answered (refused, reset, or a broken reply).
    `retriable`: the request cannot have reached the model (the connection never opened)."""

    status = 502
    reason = "upstream_failed"
    model_fault = True

    def __init__(self, message: str, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class UpstreamAnswered(InfergateError):
    """A remote model's upstream answered with an error: its status and Retry-After are
    passed on; its 5xx count against the breaker, its 4xx (the caller's fault) do not."""

    def __init__(self, status: int, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.reason = "upstream_5xx" if status >= 500 else "upstream_4xx"
        self.model_fault = status >= 500


class ConfigError(InfergateError):
    """A configuration file is wrong: names the file, the key, and what was expected."""

    reason = "config"


# Signals inside the engine: caught there, never an HTTP answer.


class VerificationFailed(Exception):
    """The file may not serve; the message says why and how to fix it."""


class NoRoom(VerificationFailed):
    """A model file's verified copy would leave too little room on the copies' file
    system (its bytes may still be what serves: a sync then hashes it without a copy)."""


class RuntimeUnavailable(Exception):
    """The runtime's library is not installed; the message says how to install it."""


class WarmupInputError(ValueError):
    """The warm-up sample file cannot give the model's inputs; the message says why."""


class WarmupFailed(Exception):
    """The gateway's warm-up input made the model fail (not necessarily the model's fault)."""


class WorkerLoadError(Exception):
    """The worker could not load its model; the message says why."""


class WorkerStartError(Exception):
    """The worker process could not be started (out of fds, memory, processes...)."""


class QueueFull(Exception):
    """No room, and nothing of a lower class to shed for it."""


class RedisUnavailable(Exception):
    """A call to Redis failed or ran past the socket timeout ([cluster]: the shared limits
    fall back to their fail_mode)."""


class ConnectFailed(Exception):
    """A remote endpoint's connection never opened: nothing was sent (may be retried)."""


class PoolTimeout(Exception):
    """No connection to a remote endpoint came free in time: nothing was sent."""


class BrokenReply(Exception):
    """A remote endpoint's answer broke off, or was not HTTP."""


class StaleConnection(BrokenReply):
    """A kept-alive connection the endpoint had closed: nothing of an answer came back
    (sent again once on a new connection, not counted as a retry)."""


class ControlFailed(Exception):
    """A control call to a remote endpoint (metadata, readiness, health) got no whole
    answer in its time or size: the message says why."""


class MetadataError(Exception):
    """A remote model's metadata is not valid V2 metadata."""


class FrontFailed(Exception):
    """A front process (`[server] fronts`) exited before it listened; its log says why."""


class BrokenOff(Exception):
    """The engine's answer broke off after it began; the front closes the connection
    (as uvicorn does when an app raises mid-answer), so no cut answer looks whole."""


class LargeAnswer(Exception):
    """encoding.encode_response's answer holds too much to encode in one go on the event
    loop; `args`: its arguments, for large_answers.encode_in_slices."""


class TooDeep(Exception):
    """The decode helper's request nests too deep for pickle to hand it back (JSON may
    nest 1,024 levels, pickle's recursion stops sooner): decoding.py decodes it on the loop."""


class CompressLater(Exception):
    """compression.compress_response was asked to compress a body too large to compress
    on the event loop, and changed nothing; `args`: the answer's headers and body."""
