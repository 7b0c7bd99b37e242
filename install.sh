#!/usr/bin/env bash
# Set up infergate in .venv (idempotent: run it again after a pull).
#
#   ./install.sh           the server and CLI (onnxruntime; the gpu extra when nvidia-smi answers)
#   ./install.sh --torch   also TorchScript models (torch 2.13.0; without a GPU, prefix
#                          PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for its CPU build)
#   ./install.sh --dev     also the tests, linters and torch
#   ./install.sh --cpu     never the gpu extra, even with a GPU present
#   ./install.sh --bench   also NVIDIA Triton for benchmarks/triton_peer.py (the bench extra)
set -euo pipefail
cd "$(dirname "$0")"

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

extras=()
gpu=auto
bench=no
for arg in "$@"; do
  case "$arg" in
    --dev) extras+=(dev torch) ;;
    --torch) extras+=(torch) ;;
    --cpu) gpu=no ;;
    --bench) bench=yes ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $arg" >&2; usage >&2; exit 2 ;;
  esac
done
if [ "$gpu" = auto ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras+=(gpu)
  echo "install.sh: nvidia-smi answers; adding the gpu extra (onnxruntime-gpu, nvidia-ml-py)"
fi

# The interpreter: python3's version, in its fastest build on this machine (the gateway's
# request path is pure Python: scripts/choose_python.py says why and how it is chosen).
# It is chosen once, when .venv is made: a .venv made before is kept (its pyvenv.cfg names
# the interpreter), and PYTHON=/path/to/python chooses for a new one. One line says which.
if [ -x .venv/bin/python ]; then
  python=.venv/bin/python
  made=$(sed -n 's/^executable = //p' .venv/pyvenv.cfg 2>/dev/null || true)
  ignored=""
  if [ -n "${PYTHON:-}" ]; then ignored=", not PYTHON=$PYTHON"; fi
  echo "install.sh: python: ${made:-.venv/bin/python} (.venv's, made before, kept$ignored;" \
    "rm -r .venv and run this again to choose anew)"
elif [ -n "${PYTHON:-}" ]; then
  python=$PYTHON
  echo "install.sh: python: $python (from PYTHON)"
else
  # scripts/choose_python.py says which and why on stderr
  if ! python=$(python3 scripts/choose_python.py); then
    python=python3
    echo "install.sh: python: python3 (scripts/choose_python.py failed)"
  fi
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install.sh: infergate needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip

spec="."
if [ ${#extras[@]} -gt 0 ]; then
  spec=".[$(printf '%s\n' "${extras[@]}" | sort -u | paste -sd, -)]"
fi
echo "install.sh: pip install -e '$spec'"
.venv/bin/python -m pip install --quiet -e "$spec"
# An editable install leaves infergate uncompiled: compile it once here, so that neither the
# first start nor every start (where PYTHONDONTWRITEBYTECODE is set) compiles it again.
.venv/bin/python -m compileall -q infergate

if [[ " ${extras[*]} " == *" gpu "* ]]; then
  # onnxruntime and onnxruntime-gpu install the same module; keep only the GPU build.
  .venv/bin/python -m pip uninstall --quiet -y onnxruntime
  .venv/bin/python -m pip install --quiet --force-reinstall --no-deps onnxruntime-gpu
fi
if [ "$bench" = yes ]; then
  # The bench extra's wheels alone (--no-deps): the benchmark runs only the server binary
  # in nvidia-pytriton, whose Python dependencies would move numpy back below 2.
  mapfile -t bench_pins < <(.venv/bin/python -c '
import tomllib
with open("pyproject.toml", "rb") as f:
    print(*tomllib.load(f)["project"]["optional-dependencies"]["bench"], sep="\n")')
  echo "install.sh: pip install --no-deps ${bench_pins[*]}"
  .venv/bin/python -m pip install --quiet --no-deps "${bench_pins[@]}"
fi
if [[ " ${extras[*]} " == *" dev "* ]] && ! command -v redis-server >/dev/null 2>&1; then
  # The cluster tests start a real redis-server (Debian's package).
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "install.sh: installing redis-server (apt-get) for the cluster tests"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }
  else
    echo "install.sh: redis-server is missing and the cluster tests need it;" \
      "install it (sudo apt-get install -y redis-server)" >&2
  fi
fi
if [[ " ${extras[*]} " == *" dev "* ]] && ! command -v valgrind >/dev/null 2>&1; then
  # benchmarks/instructions.py counts the gateway's instructions under valgrind's callgrind.
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "install.sh: installing valgrind (apt-get) for benchmarks/instructions.py"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q valgrind >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q valgrind >/dev/null; }
  else
    echo "install.sh: valgrind is missing and benchmarks/instructions.py needs it;" \
      "install it (sudo apt-get install -y valgrind)" >&2
  fi
fi
echo "install.sh: done. Next: .venv/bin/infergate serve   (and .venv/bin/infergate doctor)"
