"""The composition root: `build_gateway` wires the engine and its app once, and the app
answers in-process through httpx's ASGI transport, with real workers behind it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from infergate.profile import load_profile
from infergate.server.gateway import build_gateway
from tests.conftest import write_profile
from tests.scripted_runtime import make_scripted, scripted_inputs


async def _wait_ready(client: httpx.AsyncClient, model: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.get(f"/v2/models/{model}/ready")).status_code != 200:
        assert time.monotonic() < deadline, f"{model} not ready in {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_the_gateway_answers_in_process_through_the_asgi_transport(
    tmp_path: Path,
) -> None:
    models = tmp_path / "models"
    make_scripted(models / "echo" / "1" / "model.scripted", ("sleep_ms",))
    profile = load_profile(write_profile(tmp_path, "[tenants.default]\nrps = 1000\n"))
    engine, app = build_gateway(profile, models)
    await engine.start()  # the transport runs no lifespan: start the engine ourselves
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            await _wait_ready(client, "echo")
            body = scripted_inputs(rows=2, sleep_ms=1)
            answer = await client.post("/v2/models/echo/infer", json=body)
            assert answer.status_code == 200, answer.text
            outputs = {o["name"]: o for o in answer.json()["outputs"]}
            assert outputs["y"]["data"] == body["inputs"][0]["data"]
            assert outputs["rows"]["data"] == [2, 2]
            unknown = await client.post("/v2/models/nope/infer", json=body)
            assert unknown.status_code == 404
            assert "Request for unknown model: 'nope' is not found" in unknown.json()["error"]
            tenants = (await client.get("/admin/tenants")).json()
            assert [t["name"] for t in tenants["tenants"]] == ["default"]
            assert tenants["profile"] == str(tmp_path / "profile.toml")  # the store is wired
    finally:
        await engine.stop()
