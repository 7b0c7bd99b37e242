"""One exception tree for the engine; the HTTP edge maps each class to a status code.

InfergateError                    500
├── BadRequest                    400  (shape, dtype, size, JSON)
│   ├── PayloadTooLarge           413
│   └── TooLargeForQueue          400  (more chunks than the queue can ever hold)
├── Unauthorized / Forbidden      401 / 403
├── RateLimited                   429  (reason: rate, concurrency)
├── ModelNotFound                 404  (unknown model or version, or unloaded)
├── ModelFailed                   424  (failed to load, or its runtime is missing)
├── ModelNotReady                 503  (loading, restarting: Retry-After)
├── WorkerFailed                  503  (the worker died or was killed mid-request)
├── CircuitOpen / Overloaded      503  (Retry-After)
├── DeadlineExceeded              504  (the model ran past its execution timeout)
│   └── QueueDeadlineExceeded     504  (never started: waited past its deadline)
├── ModelExecutionError           500  (the runtime raised)
├── UpstreamFailed                502  (a remote model's endpoints gave no answer)
├── UpstreamAnswered              (the upstream's status: a remote model's error answer)
└── ConfigError                        (a model.toml or profile is wrong; not an HTTP error)

`reason` is a short, stable code for metrics labels: code reads it, never the message.
`model_fault` says whether the model itself is to blame, so a breaker counts it; load,
timeouts in the queue and the gateway's own bugs are not the model's fault.
"""

from __future__ import annotations


class InfergateError(Exception):
    """Base of every error the engine raises on purpose."""

    status = 500
    retry_after_s: float | None = None
    reason = "internal"
    model_fault = False


class BadRequest(InfergateError):
    status = 400
    reason = "bad_request"


class PayloadTooLarge(BadRequest):
    status = 413
    reason = "too_large"


class TooLargeForQueue(BadRequest):
    """More chunks than max_queue_size: no retry can make room for it."""

    reason = "too_large_for_queue"


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
    """The worker was killed for using more than its memory limit (never retried)."""


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
