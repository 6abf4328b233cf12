# The environment of a GPU machine that has PyTorch, Triton and transformers but no network.
#
#   bash scripts/gpu_env.sh bundle     here (with network): the packages such a machine lacks, as
#                                      wheels for its Python, and a redis-server binary with its two
#                                      libraries, into .gpu-deps/ (ignored by git; copy it along)
#   source scripts/gpu_env.sh          there, from the repository root: installs .gpu-deps' wheels
#                                      into /tmp/site and the project itself, editable
#                                      (pip install -e . --no-deps --no-build-isolation), so
#                                      `import tandem` and `tandem` work from the checkout
#
# GPU_PYTHON_VERSION (3.12) and GPU_PLATFORM (manylinux_2_28_x86_64) name the machine's Python.
DEPS=.gpu-deps
PACKAGES="grpcio grpcio-tools grpcio-health-checking grpcio-reflection protobuf redis structlog fastapi starlette pydantic pydantic_core annotated-types
typing-inspection uvicorn openai distro jiter sniffio annotated-doc opentelemetry-api hiredis httptools gguf llguidance
jsonschema jsonschema-specifications referencing rpds-py attrs pytest-xdist execnet"

gpu_env_bundle() {
  set -euo pipefail
  mkdir -p "$DEPS/whl" "$DEPS/bin" "$DEPS/lib"
  for spec in $PACKAGES; do
    version=$(python3 -m pip show "$spec" 2>/dev/null | awk '/^Version:/{print $2}' || true)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
      --implementation cp --platform "${GPU_PLATFORM:-manylinux_2_28_x86_64}" --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d "$DEPS/whl" "${spec}${version:+==$version}"
  done
  cp "$(readlink -f "$(command -v redis-server)")" "$DEPS/bin/redis-server"
  cp -L /lib/x86_64-linux-gnu/liblzf.so.1 /lib/x86_64-linux-gnu/libjemalloc.so.2 "$DEPS/lib/"
  # a real tokenizer for the guided-decoding benchmark (the default model's; its weights stay here;
  # needs the project installed here: pip install -e .)
  tokenizer=$(python3 -c "from tandem.models import default_gguf_file; from tandem.cluster.tokenizer import gguf_tokenizer_dir; print(gguf_tokenizer_dir(str(default_gguf_file())))" | tail -n 1)
  mkdir -p "$DEPS/tokenizers" && rm -rf "$DEPS/tokenizers/smollm2" && cp -r "$tokenizer" "$DEPS/tokenizers/smollm2"
  du -sh "$DEPS"
}

gpu_env_activate() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$DEPS"/whl/*.whl || return 1
  export PYTHONPATH=/tmp/site  # the carried dependencies; the project itself is installed below
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  export PATH=$PWD/$DEPS/bin:$PATH
  export LD_LIBRARY_PATH=$PWD/$DEPS/lib:${LD_LIBRARY_PATH:-}
  export PYTHONUNBUFFERED=1
  export BENCH_TOKENIZER=$PWD/$DEPS/tokenizers/smollm2  # tandem bench engine --guided-tokenizer (gpu.sh)
  # NVLink multicast stays off (a program using it can take a shared host's GPUs out of service)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    bundle) gpu_env_bundle ;;
    *) echo "usage: bash $0 bundle   (or: source $0, on the GPU machine)" >&2; exit 2 ;;
  esac
else
  gpu_env_activate
fi
