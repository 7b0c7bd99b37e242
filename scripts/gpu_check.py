"""What infergate does on a real NVIDIA GPU, printed line by line (scripts/gpu_check.sh runs it).

    python scripts/gpu_check.py [--port 8765] [--bench-s 3] [--backend nvml|simulated]

1. The GPUs as NVML reports them, and what onnxruntime and torch can use.
2. A gateway on the NVML backend serving, from a fresh repository:
   - `digits` (ONNX, device "auto"): placed on the GPU, run by onnxruntime's CUDA provider
     when it has one;
   - `encoder` (TorchScript, device "cuda:0", memory_mb 2048);
   - `encoder-capped` (the same, memory_mb 64: less than a CUDA context takes, so the
     memory monitor must kill its worker and say why).
   Each model's answer is checked against the same model run on the CPU in this process.
3. Each worker's device and GPU memory as /admin/stats reports them (NVML's per-process
   figure), and a short `infergate bench` of each served model.

Exit 0 when every check passed; each failed check is one line starting with FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "infergate", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return done


def environment() -> None:
    from infergate.engine.placement.devices import NvmlBackend

    for device in NvmlBackend().devices():
        print("nvml:", device)
    import onnxruntime as ort

    print("onnxruntime", ort.__version__, "providers:", ort.get_available_providers())
    try:
        import torch

        cuda = torch.cuda.is_available()
        name = torch.cuda.get_device_name(0) if cuda else "-"
        print("torch", torch.__version__, "cuda:", cuda, name, flush=True)
    except ImportError:
        print("torch: not installed", flush=True)


def repository(root: Path, gpu: str) -> None:
    shutil.copytree(ROOT / "models" / "digits", root / "digits")
    for name, memory_mb in (("encoder", 2048), ("encoder-capped", 64)):
        shutil.copytree(ROOT / "models" / "encoder", root / name)
        toml = root / name / "model.toml"
        text = toml.read_text().replace(
            'runtime = "torchscript"',
            f'runtime = "torchscript"\ndevice = "{gpu}"\nmemory_mb = {memory_mb}',
        )
        toml.write_text(text)


def expected(model: str, batch: np.ndarray) -> np.ndarray:
    """The model run on the CPU in this process."""
    if model == "digits":
        import onnxruntime as ort

        session = ort.InferenceSession(
            str(ROOT / "models/digits/1/model.onnx"), providers=["CPUExecutionProvider"]
        )
        name = session.get_inputs()[0].name
        return np.asarray(session.run(None, {name: batch})[0])
    import torch

    module = torch.jit.load(str(ROOT / "models/encoder/1/model.pt"), map_location="cpu")
    with torch.inference_mode():
        return np.asarray(module(torch.from_numpy(batch)).numpy())


def infer(client: httpx.Client, model: str, batch: np.ndarray) -> np.ndarray:
    meta = client.get(f"/v2/models/{model}").json()
    spec = meta["inputs"][0]
    body = {
        "inputs": [
            {
                "name": spec["name"],
                "datatype": spec["datatype"],
                "shape": list(batch.shape),
                "data": batch.ravel().tolist(),
            }
        ]
    }
    answer = client.post(f"/v2/models/{model}/infer", json=body, timeout=60)
    answer.raise_for_status()
    out = answer.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def wait_for(client: httpx.Client, model: str, states: set[str], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    status: Any = None
    while time.monotonic() < deadline:
        answer = client.get(f"/admin/models/{model}")
        if answer.status_code == 200:
            status = answer.json()
            if status.get("state") in states:
                return status
        time.sleep(0.2)
    return status


def served(url: str, bench_s: float, placed_on: str, runs_on: str) -> None:
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=url, timeout=30) as client:
        for model in ("digits", "encoder"):
            status = wait_for(client, model, {"ready", "failed", "unavailable"}, 120)
            state = status and status.get("state")
            check(state == "ready", f"{model}: ready (state {state})")
            if state != "ready":
                print(json.dumps(status, indent=1)[:3000])
                continue
            instances = [i for v in status["versions"] for i in v["instances"]]
            for i in instances:
                print(
                    f"     {model} instance {i['index']}: placed on {i['placed_on']}, "
                    f"runs on {i['device']}, visible devices {i['visible_devices']}"
                )
            check(
                all(i["placed_on"] == placed_on and i["device"] == runs_on for i in instances),
                f"{model}: every instance placed on {placed_on} and running on {runs_on}",
            )
            shape = (5, 64) if model == "digits" else (5, 8)
            batch = rng.standard_normal(shape).astype(np.float32)
            got, want = infer(client, model, batch), expected(model, batch)
            close = got.shape == want.shape and np.allclose(got, want, rtol=1e-3, atol=1e-4)
            diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else None
            check(close, f"{model}: the GPU's answer matches the CPU's (max |diff| {diff})")

        # A CUDA context alone is hundreds of MB: a 64 MB limit must end in a kill, named.
        capped = wait_for(client, "encoder-capped", {"failed", "unavailable"}, 60)
        print("     encoder-capped:", json.dumps(capped)[:1500])
        reasons = " ".join(
            str(i.get("reason") or "")
            for v in (capped or {}).get("versions", [])
            for i in v.get("instances", [])
        ) + str((capped or {}).get("reason") or "")
        check(
            "memory" in reasons.lower(),
            "encoder-capped: its worker over memory_mb 64 is killed and the reason says memory",
        )

        stats = client.get("/admin/stats").json()
        print("     backend:", stats["backend"])
        for device in stats["devices"]:
            print("     device:", device)
        for worker in stats["workers"]:
            print("     worker:", worker)
        gpu_workers = [w for w in stats["workers"] if w["device"] == placed_on]
        check(
            any((w["memory_mb"] or 0) > 0 for w in gpu_workers),
            "stats: GPU workers' memory is reported (NVML's per-process figure)",
        )

    for model in ("digits", "encoder") if bench_s > 0 else ():
        done = cli(
            "bench", model, "--concurrency", "1,16", "--duration", str(bench_s), "--url", url
        )
        print(done.stdout, done.stderr, sep="", end="", flush=True)
        check(done.returncode == 0, f"infergate bench {model}: exit {done.returncode}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--bench-s", type=float, default=3.0, help="0: no bench")
    # simulated: a dry run of this script on a machine without a GPU (placed on sim:0,
    # run on the CPU, the workers' RSS taken for their GPU memory)
    parser.add_argument("--backend", choices=("nvml", "simulated"), default="nvml")
    args = parser.parse_args()
    nvml = args.backend == "nvml"
    if nvml:
        environment()
    with tempfile.TemporaryDirectory(prefix="infergate-gpu-") as tmp:
        models = Path(tmp) / "models"
        repository(models, "cuda:0" if nvml else "auto")
        profile = Path(tmp) / "profile.toml"
        profile.write_text(
            f'[devices]\nbackend = "{args.backend}"\nmonitor_interval_s = 0.2\n'
            + ("" if nvml else "simulated_mb = [16000]\n")
        )
        log = Path(tmp) / "serve.log"
        url = f"http://127.0.0.1:{args.port}"
        with log.open("wb") as out:
            server = subprocess.Popen(
                [sys.executable, "-m", "infergate", "serve", "--models", str(models)]
                + ["--profile", str(profile), "--port", str(args.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    if httpx.get(f"{url}/v2/health/live", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            check(server.poll() is None, "the gateway started")
            if server.poll() is None:
                if nvml:
                    served(url, args.bench_s, "cuda:0", "cuda:0")
                else:
                    served(url, args.bench_s, "sim:0", "cpu")
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
            print("---- the gateway's log (last 60 lines)")
            print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    print(f"{len(failures)} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
