"""`[server] private_models = true`: what the gateway says about models is only for those
who may use them, not only inference.

By default (as in Triton) metadata, readiness, configuration, statistics and `/metrics`
are open: any client that reaches the port learns which models are served, their state,
a failed one's reason and their traffic. With this on, in front of the app (the infer
route has its own checks):

- `GET /v2/models/{name}[/versions/{v}][/ready|/config|/stats]` needs a key: an admin key
  sees every model; a tenant's (or, with `allow_anonymous`, none: the default tenant)
  only those in its `models`, with 403 for the rest whether they exist or not, and a 404
  that names only its own;
- `GET /v2/models/stats` (every model) and `/metrics` need an admin key.

Health and `GET /v2` say nothing about models and stay open.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from infergate.engine.engine import Engine
from infergate.errors import Forbidden, InfergateError, Unauthorized
from infergate.server.infer_request import api_key

_MODELS = "/v2/models/"


class PrivateModels:
    def __init__(self, engine: Engine, app: ASGIApp) -> None:
        self._engine = engine
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                self._check(scope["path"], scope["headers"])
            except InfergateError as exc:
                await _refuse(send, exc)
                return
        await self._app(scope, receive, send)

    def _check(self, path: str, raw: list[tuple[bytes, bytes]]) -> None:
        headers = dict(raw)
        if path == "/metrics" or path == _MODELS + "stats":
            self._admin_only(headers, raw, path)
            return
        if not path.startswith(_MODELS):
            return
        name = path[len(_MODELS) :].split("/", 1)[0]
        key = api_key(headers, raw)
        tenants = self._engine.context.tenants
        if tenants.is_admin(key):
            return
        state = tenants.authenticate(key)  # 401 for a missing or unknown key
        tenants.check_allowed(state, name)  # 403, whether or not the model exists
        # 404 naming only its own models, before the app's (which names every model)
        self._engine.registry.record(name, state.tenant.may_use)

    def _admin_only(
        self, headers: dict[bytes, bytes], raw: list[tuple[bytes, bytes]], path: str
    ) -> None:
        key = api_key(headers, raw)
        if self._engine.context.tenants.is_admin(key):
            return
        what = "metrics" if path == "/metrics" else "every model's statistics"
        if key is None:
            raise Unauthorized(
                f"with server.private_models, {what} need the admin key (Authorization: "
                "Bearer <key>). Hint: a tenant reads its own model's /v2/models/NAME/stats"
            )
        raise Forbidden(
            f"with server.private_models, {what} need one of server.admin_keys. Hint: a "
            "tenant reads its own model's /v2/models/NAME/stats"
        )


async def _refuse(send: Send, error: InfergateError) -> None:
    body = orjson.dumps({"error": str(error)})
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
