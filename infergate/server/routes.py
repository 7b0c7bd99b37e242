"""Route tables for the app's routes other than inference, on Starlette's own routing.

Each endpoint takes the request and reads its path parameters (`request.path_params`);
a guarded route runs its guard (the admin key check) first. Starlette is what FastAPI is
built on, without FastAPI's signature analysis, validation and OpenAPI models, whose
import and route building were about a third of a gateway's start-up CPU (0.97 -> 0.62 s
with an empty repository; docs/performance.md, "Start-up")."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

Endpoint = Callable[[Request], Awaitable[Response]]
Guard = Callable[[Request], Awaitable[None]]


class Routes:
    """Routes declared with `@routes.get(path, ...)`, in order: the first that matches a
    request's path serves it (a fixed path such as /v2/models/stats before a pattern that
    would also match it)."""

    def __init__(self, guard: Guard | None = None) -> None:
        self.routes: list[BaseRoute] = []
        self._guard = guard  # for every route of this table

    def get(self, *paths: str, guard: Guard | None = None) -> Callable[[Endpoint], Endpoint]:
        return self._add("GET", paths, guard)

    def post(self, *paths: str, guard: Guard | None = None) -> Callable[[Endpoint], Endpoint]:
        return self._add("POST", paths, guard)

    def patch(self, *paths: str, guard: Guard | None = None) -> Callable[[Endpoint], Endpoint]:
        return self._add("PATCH", paths, guard)

    def delete(self, *paths: str, guard: Guard | None = None) -> Callable[[Endpoint], Endpoint]:
        return self._add("DELETE", paths, guard)

    def include(self, other: Routes) -> None:
        self.routes.extend(other.routes)

    def _add(
        self, method: str, paths: tuple[str, ...], guard: Guard | None
    ) -> Callable[[Endpoint], Endpoint]:
        guard = guard or self._guard

        def add(endpoint: Endpoint) -> Endpoint:
            served = endpoint if guard is None else _guarded(guard, endpoint)
            for path in paths:
                self.routes.append(Route(path, served, methods=[method]))
            return served  # the name in the module is the guarded endpoint too

        return add


def optional_param(request: Request, name: str) -> str | None:
    """A route's optional part (a version, a region): from its path when the route names it
    there (`/versions/{version}`), else from the query (`?version=1`), where clients of
    the FastAPI routes could also give it."""
    value = request.path_params.get(name)
    return value if value is not None else request.query_params.get(name)


def _guarded(guard: Guard, endpoint: Endpoint) -> Endpoint:
    async def run(request: Request) -> Response:
        await guard(request)  # raises the 401 or 403
        return await endpoint(request)

    run.__name__ = run.__qualname__ = endpoint.__name__  # Starlette names a route by it
    return run
