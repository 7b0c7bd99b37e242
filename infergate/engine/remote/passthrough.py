"""A request for a remote model, passed through without decoding its tensors: the class
and deadlines a tenant gets, the breaker, then the body upstream unchanged.

The caller holds an admission (Engine.admit) and has parsed only the JSON header.
"""

from __future__ import annotations

import asyncio
from typing import Any

from infergate.engine.admission.tenants import TenantState
from infergate.engine.context import EngineContext
from infergate.engine.remote.client import UpstreamReply
from infergate.engine.remote.http1 import Payload
from infergate.engine.remote.served import RemoteServedVersion


async def forward_admitted(
    context: EngineContext,
    served: RemoteServedVersion,
    body: Payload,
    headers: dict[str, str],
    priority: Any,
    timeout_s: float | None,
    tenant: TenantState,
) -> UpstreamReply:
    classes = context.settings.classes
    cls = classes.resolve(priority, cap=classes.get(tenant.tenant.cls))
    # As for a local model: the class deadline (and the client's timeout) bound the wait
    # to start, here the wait for a connection; the model's timeout_ms bounds the rest.
    start_within = cls.deadline_s if timeout_s is None else min(cls.deadline_s, timeout_s)
    who = tenant.tenant.name
    admission = served.breaker.allow(who)
    if admission == "refused":
        raise served.circuit_open(who)
    now = context.clock.now()
    try:
        reply = await served.forward(
            body, headers, now + start_within, now + served.config.timeout_s, (cls.rank, who)
        )
    except asyncio.CancelledError:  # its client left, or the gateway stops: no verdict
        served.breaker.unjudged(admission)
        raise
    except Exception as exc:
        served.breaker_failed(admission, exc, who)
        raise
    if reply.status >= 500:
        served.breaker.record(admission, False, None, who)
    else:
        served.breaker.record(admission, True, context.clock.now() - now, who)
    return reply
