"""The one place engine errors become HTTP answers: status, {"error": ...}, Retry-After."""

from __future__ import annotations

import math

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ExceptionHandler

from infergate.errors import InfergateError


def retry_after_header(seconds: float) -> str:
    """Whole seconds, at least 1, as Retry-After wants them."""
    return str(max(1, math.ceil(seconds)))


def error_body(error: Exception | str) -> bytes:
    return orjson.dumps({"error": str(error)})


def error_response(status: int, message: str, retry_after_s: float | None = None) -> Response:
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = retry_after_header(retry_after_s)
    return Response(
        error_body(message), status_code=status, media_type="application/json", headers=headers
    )


def error_handlers() -> dict[type[Exception], ExceptionHandler]:
    """The app's handlers: an engine error's status and message, and Starlette's own 404
    and 405 said as what they are, in the same JSON shape."""

    async def on_engine_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, InfergateError)
        return error_response(exc.status, str(exc), exc.retry_after_s)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        answer = error_response(exc.status_code, message)
        if exc.headers and "Allow" in exc.headers:  # a 405 says which methods the path takes
            methods = sorted(m.strip() for m in exc.headers["Allow"].split(","))
            answer.headers["Allow"] = ", ".join(methods)  # (Starlette's are in a set's order)
        return answer

    return {InfergateError: on_engine_error, HTTPException: on_http_error}
