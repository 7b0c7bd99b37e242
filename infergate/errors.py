"""One exception tree for the engine; the HTTP edge maps each class to a status code.

InfergateError                    500
├── BadRequest                    400  (shape, dtype, size, JSON)
│   └── PayloadTooLarge           413
├── ModelNotFound                 404  (unknown model or version)
├── ModelNotReady                 503  (loading, restarting, unavailable)
├── WorkerFailed                  503  (the worker died or was killed mid-request)
├── DeadlineExceeded              504  (the request ran past its timeout)
├── ModelExecutionError           500  (the runtime raised)
└── ConfigError                        (a model.toml or profile is wrong; not an HTTP error)
"""

from __future__ import annotations


class InfergateError(Exception):
    """Base of every error the engine raises on purpose."""

    status = 500
    retry_after_s: float | None = None


class BadRequest(InfergateError):
    status = 400


class PayloadTooLarge(BadRequest):
    status = 413


class Unauthorized(InfergateError):
    status = 401


class Forbidden(InfergateError):
    status = 403


class RateLimited(InfergateError):
    status = 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class CircuitOpen(InfergateError):
    status = 503

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotFound(InfergateError):
    status = 404


class ModelNotReady(InfergateError):
    status = 503
    retry_after_s = 1.0


class WorkerFailed(InfergateError):
    status = 503
    retry_after_s = 1.0


class WorkerOverMemory(WorkerFailed):
    """The worker was killed for using more than its memory limit (never retried)."""


class Overloaded(InfergateError):
    status = 503
    retry_after_s = 1.0


class DeadlineExceeded(InfergateError):
    status = 504


class ModelExecutionError(InfergateError):
    status = 500


class ConfigError(InfergateError):
    """A configuration file is wrong: names the file, the key, and what was expected."""
