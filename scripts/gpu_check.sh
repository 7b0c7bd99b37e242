#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install (the gpu extra comes when nvidia-smi answers),
# then scripts/gpu_check.py: NVML's devices, an ONNX and a TorchScript model served from the
# GPU and checked against the CPU, a worker over its memory_mb killed, a short bench.
#   scripts/gpu_check.sh               ./install.sh, then the checks with .venv/bin/python
#   scripts/gpu_check.sh --no-install  the checks with $PYTHON (default .venv/bin/python) as
#                                      it is: a machine with no package index, say, whose
#                                      packages are in place already
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
if [ "${1:-}" != --no-install ]; then
  ./install.sh
fi
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py
