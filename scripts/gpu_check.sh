#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install the gpu extra, list devices through NVML, serve
# the example model on the CUDA provider, run an inference, and print what was seen.
#   scripts/gpu_check.sh            (uses ./.venv, made by install.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
./install.sh
py=.venv/bin/python
$py - <<'PY'
from infergate.engine.placement.devices import NvmlBackend
backend = NvmlBackend()
for d in backend.devices():
    print("nvml:", d)
import onnxruntime as ort
print("onnxruntime", ort.__version__, "providers:", ort.get_available_providers())
PY
port=8765
profile=$(mktemp --suffix=.toml)
printf '[devices]\nbackend = "nvml"\n' > "$profile"
.venv/bin/infergate serve --port $port --profile "$profile" > /tmp/infergate-gpu.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf localhost:$port/v2/health/ready >/dev/null && break
  sleep 0.5
done
.venv/bin/infergate model status digits --url http://127.0.0.1:$port
.venv/bin/infergate infer digits examples/digit-7.npy --url http://127.0.0.1:$port
curl -s localhost:$port/admin/stats | $py -c 'import json,sys; d=json.load(sys.stdin); print("backend:", d["backend"]); [print("device:", x) for x in d["devices"]]; [print("worker:", w) for w in d["workers"]]'
.venv/bin/infergate bench digits --concurrency 1,16 --duration 3 --url http://127.0.0.1:$port
