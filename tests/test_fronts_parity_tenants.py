"""`[server] fronts`: a tenant's limits and keys hold alike in one process and in a gateway
behind a front, compared answer for answer (byte for byte, the Date aside) as they change:
a tenant over its rate, or at its concurrency, is refused alike and gets its slot back; a
key the front knows, revoked by a live profile edit, is refused alike and served alike
once given back; and after all the parity tests, neither gateway holds a slot. (The pair
of gateways, conftest's `parity_pair`: tests/fronts_parity.py.)"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx

from tests.fronts_parity import (
    GOOD,
    REVOKED,
    SINGLE,
    SLOW,
    Pair,
    X,
    _profile,
    exchange,
    infer_request,
    json_body,
    status_of,
)
from tests.polling import wait_until
from tests.scripted_runtime import holding
from tests.server import ServerProcess


def _tenant(server: ServerProcess, name: str) -> dict[str, Any]:
    doc = httpx.get(f"{server.url}/admin/tenants", timeout=10).json()
    found: dict[str, Any] = next(t for t in doc["tenants"] if t["name"] == name)
    return found


def test_a_tenant_over_its_rate_is_refused_alike(parity_pair: Pair) -> None:
    """Its first two requests served, then 429s with the same Retry-After and message,
    whatever the body (a front decodes none of them: see the last tests)."""
    heavy = json_body({"inputs": [{**X, "shape": [1000, 4], "data": [0.5] * 4000}]})
    requests = [infer_request(GOOD, key=SLOW)] * 2 + [
        infer_request(GOOD, key=SLOW),
        infer_request(heavy, key=SLOW),
        infer_request(b"{", key=SLOW),
        infer_request(GOOD, "nope", key=SLOW),
    ]
    one = [exchange(parity_pair.one.port, r)[0] for r in requests]
    split = [exchange(parity_pair.split.port, r)[0] for r in requests]
    assert [status_of(a) for a in one] == [200, 200, 429, 429, 429, 404]
    assert split == one


def _held(value: int) -> bytes:
    """A request of the tenant with one slot, its call held in the worker until the
    file release-`value` exists (0: not held)."""
    doc = {
        "inputs": [X, {"name": "hold", "datatype": "INT64", "shape": [1, 1], "data": [value]}],
        "outputs": [{"name": "y"}],  # (not its worker's pid)
    }
    return infer_request(json_body(doc), "held", key=SINGLE)


def _over_concurrency(server: ServerProcess, gates: Path, gate: int) -> list[bytes]:
    """Two served; one held while two more come (429s); its client leaves, its call
    ends, the slot comes back, and one more is served."""
    answers = exchange(server.port, _held(0)) + exchange(server.port, _held(0))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as holder:
        holder.sendall(_held(gate))
        wait_until(lambda: holding(gates, gate), 30, "the call held")
        assert _tenant(server, "single")["in_flight"] == 1
        answers += exchange(server.port, _held(0))  # over its concurrency
        answers += exchange(server.port, infer_request(b"{", "held", key=SINGLE))
    (gates / f"release-{gate}").touch()  # its client has gone; the call ends
    wait_until(lambda: _tenant(server, "single")["in_flight"] == 0, 30, "the slot back")
    return answers + exchange(server.port, _held(0))


def test_a_tenant_at_its_concurrency_is_refused_alike_and_gets_its_slot_back(
    parity_pair: Pair,
) -> None:
    """One request held in the worker; the tenant's next are 429s, alike; its client
    leaves, the call ends, and the slot is free again (in both, never leaked)."""
    one = _over_concurrency(parity_pair.one, parity_pair.gates, 1)
    split = _over_concurrency(parity_pair.split, parity_pair.gates, 2)
    assert [status_of(a) for a in one] == [200, 200, 429, 429, 200]
    assert split == one


def test_a_key_revoked_while_a_front_knows_it_is_refused_alike(parity_pair: Pair) -> None:
    """A key the front has seen served, revoked by a live profile edit: 401s alike
    (decoded by the front or not); given back, served again alike."""
    requests = [
        infer_request(GOOD, key=REVOKED),
        infer_request(b"{", key=REVOKED),
        infer_request(GOOD, key=REVOKED),
    ]

    def keys(count: int) -> bool:
        return all(
            _tenant(s, "revocable")["keys"] == count for s in (parity_pair.one, parity_pair.split)
        )

    def answers() -> list[list[bytes]]:
        return [
            [exchange(s.port, r)[0] for r in requests] for s in (parity_pair.one, parity_pair.split)
        ]

    served = answers()
    assert [status_of(a) for a in served[0]] == [200, 400, 200]
    assert served[0] == served[1]
    try:
        for fronts in (0, 1):
            (parity_pair.folder / f"profile-{fronts}.toml").write_text(
                _profile(fronts, revoked=True)
            )
        wait_until(lambda: keys(0), 30, "the key revoked")
        refused = answers()
        assert [status_of(a) for a in refused[0]] == [401, 401, 401]
        assert refused[0] == refused[1]
    finally:
        for fronts in (0, 1):
            (parity_pair.folder / f"profile-{fronts}.toml").write_text(_profile(fronts))
        wait_until(lambda: keys(1), 30, "the key given back")
    again = answers()
    assert again == served


def test_the_parity_servers_left_nothing_in_flight(parity_pair: Pair) -> None:
    """After everything above, and the corpus's tests before it (they run first,
    conftest's PARITY_FILES): no tenant holds a slot in either gateway."""
    for server in (parity_pair.one, parity_pair.split):
        doc = httpx.get(f"{server.url}/admin/tenants", timeout=10).json()
        assert {t["name"]: t["in_flight"] for t in doc["tenants"]} == {
            t["name"]: 0 for t in doc["tenants"]
        }
        assert server.process is not None
        assert server.process.poll() is None
