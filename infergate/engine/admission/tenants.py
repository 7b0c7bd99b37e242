"""Tenants: who is calling, what they may use, and their live admission state.

API keys are stored only as SHA-256 hashes ("sha256:<hex>"); a key is shown once, when it
is made. Keyless requests map to the `default` tenant only where the profile allows it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import math
import re
import secrets
import sys
from dataclasses import dataclass, field
from typing import NoReturn

from infergate.clock import Clock
from infergate.engine.admission.limits import ConcurrencyLimit, TokenBucket, retry_seconds
from infergate.engine.scheduling.queue import Fairness
from infergate.errors import Forbidden, RateLimited, Unauthorized

DEFAULT_TENANT = "default"


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "ig_" + secrets.token_urlsafe(24)


# Limits are opt-in, as in every peer: a tenant whose profile entry sets no rps or
# max_concurrency has no such limit (the admin API shows it as null).
NO_RATE_LIMIT = math.inf
NO_CONCURRENCY_LIMIT = sys.maxsize


@dataclass(frozen=True)
class Tenant:
    name: str
    cls: str = "burst"  # the highest class it may ask for, and its default
    rps: float = NO_RATE_LIMIT
    burst: float = NO_RATE_LIMIT
    max_concurrency: int = NO_CONCURRENCY_LIMIT
    models: tuple[str, ...] = ("*",)  # glob patterns of the models it may use
    devices: tuple[str, ...] = ("auto",)
    memory_mb: int = 4096
    # The profile set memory_mb: what its models' workers that reserve nothing (no memory_mb
    # in model.toml) use is held to the quota too (engine/placement/monitor.py).
    memory_enforced: bool = False
    api_keys: tuple[str, ...] = ()  # "sha256:<hex>"
    weight: float = 1.0  # its share of a queue against tenants of the same class

    # The allow-list as one compiled pattern, and whether it allows every model (the
    # default): may_use is asked three times a request.
    _allowed: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _everything: bool = field(init=False, repr=False, compare=False)
    # Whose requests these are in a queue's fair sharing: the same for all of them.
    fairness: Fairness = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        either = "|".join(f"(?:{fnmatch.translate(p)})" for p in self.models) or "(?!)"
        object.__setattr__(self, "_allowed", re.compile(either))
        object.__setattr__(self, "_everything", "*" in self.models)
        object.__setattr__(self, "fairness", Fairness(self.name, self.weight))

    def may_use(self, model: str) -> bool:
        return self._everything or self._allowed.match(model) is not None


@dataclass
class TenantState:
    tenant: Tenant
    bucket: TokenBucket
    concurrency: ConcurrencyLimit
    admitted: int = 0
    rate_limited: int = 0
    over_concurrency: int = 0
    forbidden: int = 0


class Tenants:
    def __init__(
        self,
        tenants: list[Tenant],
        admin_keys: tuple[str, ...],
        allow_anonymous: bool,
        clock: Clock,
    ) -> None:
        self._clock = clock
        self._states: dict[str, TenantState] = {}
        self.admin_keys: tuple[str, ...] = ()
        self.allow_anonymous = allow_anonymous
        self.configure(tenants, admin_keys, allow_anonymous)

    def configure(
        self, tenants: list[Tenant], admin_keys: tuple[str, ...], allow_anonymous: bool
    ) -> None:
        """Apply a (new) profile: buckets of tenants that stay keep their tokens."""
        states = {}
        for tenant in tenants:
            old = self._states.get(tenant.name)
            if old is not None:
                old.bucket.reconfigure(tenant.rps, tenant.burst)
                old.concurrency.limit = tenant.max_concurrency
                old.tenant = tenant
                states[tenant.name] = old
            else:
                states[tenant.name] = TenantState(
                    tenant,
                    TokenBucket(tenant.rps, tenant.burst, self._clock),
                    ConcurrencyLimit(tenant.max_concurrency),
                )
        self._states = states
        self.admin_keys = admin_keys
        self.allow_anonymous = allow_anonymous
        self._by_hash = {h: name for name, st in states.items() for h in st.tenant.api_keys}

    def states(self) -> list[TenantState]:
        return [self._states[k] for k in sorted(self._states)]

    def get(self, name: str) -> TenantState:
        return self._states[name]

    def authenticate(self, key: str | None) -> TenantState:
        if key is None:
            if self.allow_anonymous and DEFAULT_TENANT in self._states:
                return self._states[DEFAULT_TENANT]
            raise Unauthorized(
                "an API key is required: send it as 'Authorization: Bearer <key>' or "
                "'X-API-Key: <key>' (the CLI: --token or INFERGATE_TOKEN). Hint: an operator "
                "makes one with infergate tenant add NAME"
            )
        name = self._by_hash.get(hash_key(key))
        if name is None:
            raise Unauthorized(
                "unknown API key. Hint: check the key sent (the CLI's --token or "
                "INFERGATE_TOKEN), or ask an operator for one (infergate tenant add)"
            )
        return self._states[name]

    def is_admin(self, key: str | None) -> bool:
        if not self.admin_keys:
            return True  # no admin keys: the admin API is open (loopback only; see serve)
        if key is None:
            return False
        digest = hash_key(key)
        return any(hmac.compare_digest(digest, k) for k in self.admin_keys)

    def admit(self, state: TenantState, model: str) -> None:
        """Allow-list, then rate, then concurrency; on success the caller must `leave`."""
        self.check_allowed(state, model)
        wait = state.bucket.try_take()
        if wait > 0:
            self.refuse_rate(state, wait)
        if not state.concurrency.try_enter():
            self.refuse_concurrency(state)
        state.admitted += 1

    # The refusals, shared with the limits kept in Redis (engine/cluster/), so a client
    # reads the same answer whichever replica or path refused it.
    @staticmethod
    def check_allowed(state: TenantState, model: str) -> None:
        tenant = state.tenant
        if not tenant.may_use(model):
            state.forbidden += 1
            raise Forbidden(
                f"tenant {tenant.name!r} may not use model {model!r} (allowed: "
                f"{', '.join(tenant.models) or 'none'}). Hint: an operator can add it to "
                f"the tenant's models (infergate tenant set {tenant.name} models=...)"
            )

    @staticmethod
    def refuse_rate(state: TenantState, wait_s: float) -> NoReturn:
        tenant = state.tenant
        state.rate_limited += 1
        # Whole seconds, so the message says what the Retry-After header says.
        seconds = retry_seconds(wait_s)
        hint = (
            "; its rps is 0, so it gets no more requests until an operator raises it "
            "(infergate tenant set)"
            if tenant.rps <= 0
            else ""
        )
        raise RateLimited(
            f"tenant {tenant.name!r} is over its rate of {tenant.rps:g} requests/s "
            f"(burst {tenant.burst:g}); retry in {seconds} s{hint}",
            seconds,
            reason="rate",
        )

    @staticmethod
    def refuse_concurrency(state: TenantState) -> NoReturn:
        state.over_concurrency += 1
        raise RateLimited(
            f"tenant {state.tenant.name!r} already has {state.tenant.max_concurrency} "
            "requests in flight (max_concurrency); retry in 1 s, or when one finishes",
            1,
            reason="concurrency",
        )

    @staticmethod
    def leave(state: TenantState) -> None:
        state.concurrency.leave()
